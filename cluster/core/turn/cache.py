"""The session cache: `ResponseState`, everything the next turn needs from a finished response;
`SessionCache`, a bounded LRU of them per connection or per replica; `CacheMemory`, one byte bound
over all the connection caches of a replica."""

from __future__ import annotations

import json
import sys
import time
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from cluster.core.messages import PriorOutput


@dataclass(frozen=True)
class RenderKey:
    """What a rendered token prefix depends on besides the items themselves."""

    instructions: Optional[str]
    # JSON of the normalized tools in their own key order: templates render tools with `tojson`,
    # which keeps dict order, so tools differing only in key order render differently (and the
    # render audit re-renders from this text: sorted keys made every sampled check a mismatch).
    tools_json: str
    reasoning_effort: Optional[str] = None

    @classmethod
    def of(cls, instructions: Optional[str], tools: list[dict[str, Any]],
           reasoning_effort: Optional[str] = None) -> "RenderKey":
        return cls(instructions, json.dumps(tools, separators=(",", ":")), reasoning_effort)


@dataclass
class RenderedPrefix:
    """Token ids of the chat-template render of `items[:item_count]` (no generation prompt)."""

    key: RenderKey
    item_count: int
    token_ids: array  # array('i'): compact, cheap to copy and to pickle
    # Index into items where the last rendered chat message starts: the anchor
    # that the next delta render is rendered after.
    anchor_start: int
    # The engine request whose prompt starts with `token_ids` (its replica keeps that
    # prompt, so the next turn sends only its tail); None when no such prompt ran.
    engine_request_id: Optional[str] = None
    # The generation prompt after `token_ids` and what the engine generated after it: the
    # next turn reuses those token ids (`render.IncrementalRenderer.delta`).
    prior: Optional[PriorOutput] = None
    # A vision model's images in `token_ids` (decoded, in order) and the tokens the engine adds
    # expanding them (`turn.Rendered`).
    images: tuple[bytes, ...] = ()
    image_tokens: int = 0
    # The chat roles of `items[:item_count]`: a content-dependent template renders no delta once
    # the conversation holds some of them (render/template_analysis.py).
    roles: frozenset = frozenset()


@dataclass
class ResponseState:
    """State of one finished response, as a continuation needs it."""

    response_id: str
    model: str
    items: list[dict[str, Any]]  # resolved context: all ancestors' input + output, then ours
    output_start: int  # items[output_start:] is this response's own output
    instructions: Optional[str]
    tools: list[dict[str, Any]]  # the request's tools as sent (for the Response object)
    rendered: Optional[RenderedPrefix]
    known_call_ids: frozenset[str]
    pending_call_ids: tuple[str, ...]  # function calls without output, in order
    store: bool = True
    owner: Optional[str] = None  # the tenant that created it; other tenants never see it
    input_start: int = 0  # items[input_start:output_start] is this response's own input
    affinity_key: Optional[str] = None  # the session key engine calls are routed by
    engine_replica: str = ""  # the replica that holds this context's prefix KV
    # Set when output safety flags this response after its terminal event
    # (post-inference classification of the output's tail): no continuation.
    blocked: Optional[dict[str, Any]] = None
    response: Optional[dict[str, Any]] = None  # the final Response object (JSON form)
    # Payload bytes of the whole context (every item this state keeps alive,
    # rendered or not: text, images, encrypted reasoning, unknown keys). A turn
    # adds its own items to its parent's count: O(new items).
    context_bytes: int = field(default=0)
    nbytes: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.context_bytes:
            self.context_bytes = items_nbytes(self.items)  # no parent count (a store load): O(history) once
        if not self.nbytes:
            self.nbytes = estimate_nbytes(self)


def estimate_nbytes(state: ResponseState) -> int:
    """Memory this state keeps alive, for the byte bounds of the caches (approximate, monotone).

    The whole context counts, not only this response's own items: a cache that
    holds only this state keeps all of it alive.
    """
    tokens = len(state.rendered.token_ids) * 4 + sum(map(len, state.rendered.images)) if state.rendered else 0
    if state.rendered is not None and state.rendered.prior is not None:
        prior = state.rendered.prior
        tokens += 4 * (len(prior.generation) + len(prior.token_ids)) + len(prior.text)
    # (The Response object shares its output items with the context, and its tools and
    # instructions with the state; the rest of it echoes the request's strings.)
    request = _size(state.tools) + _size(state.instructions or "") + _size(state.affinity_key or "")
    if state.rendered is not None:  # the tools again, as the JSON text the render key keeps
        request += _size(state.rendered.key.tools_json)
    if state.response:
        request += _size({k: v for k, v in state.response.items() if k not in _SHARED_WITH_STATE})
    return 256 + tokens + 8 * len(state.items) + state.context_bytes + request


_SHARED_WITH_STATE = frozenset({"output", "tools", "instructions"})


def items_nbytes(items: list[dict[str, Any]]) -> int:
    return sum(_size(item) for item in items)


def text_chars(value: Any) -> int:
    """Characters of the strings in a JSON-like value (keys included): what a template that renders
    it (tool definitions as JSON) writes at least."""
    return _size(value, overhead=False)


def _size(value: Any, overhead: bool = True) -> int:
    """Payload bytes of a JSON-like value (strings by length, containers by their members; with
    `overhead`, each object's own). Iterative: a client's nesting depth never reaches Python's
    recursion limit here."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            # What CPython holds: 1, 2 or 4 bytes a character (a string of emoji is 4x its length).
            total += sys.getsizeof(v) if overhead else len(v)
        elif isinstance(v, dict):
            total += 64 * overhead
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            total += 56 * overhead
            stack.extend(v)
        else:
            total += 24 * overhead
    return total


class SessionCache:
    """LRU bounded by entries and bytes; never evicts the most recent response itself.

    Keeping the latest one even when it alone exceeds the byte bound is what
    makes the next turn of an agent loop a cache hit (docs/protocol.md). A cache
    that belongs to a `CacheMemory` may still be emptied by it when the
    replica as a whole is over its bound and this connection is the least
    recently used.
    """

    def __init__(self, max_entries: int = 64, max_bytes: int = 256 * 1024 * 1024,
                 memory: Optional["CacheMemory"] = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, ResponseState] = OrderedDict()
        self._bytes = 0
        self._memory = memory
        self.last_used = time.monotonic()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> Optional[ResponseState]:
        state = self._entries.get(response_id)
        if state is None:
            self.misses += 1
            return None
        self._entries.move_to_end(response_id)
        self.last_used = time.monotonic()
        self.hits += 1
        return state

    def peek(self, response_id: str) -> Optional[ResponseState]:
        """Without touching recency or hit counts."""
        return self._entries.get(response_id)

    def put(self, state: ResponseState) -> None:
        old = self._entries.pop(state.response_id, None)
        if old is not None:
            self._account(-old.nbytes)
        self._entries[state.response_id] = state
        self._account(state.nbytes)
        self.last_used = time.monotonic()
        self._shrink()
        if self._memory is not None:
            self._memory.reclaim(self)

    def evict(self, response_id: str) -> bool:
        state = self._entries.pop(response_id, None)
        if state is None:
            return False
        self._account(-state.nbytes)
        return True

    def clear(self) -> None:
        self._account(-self._bytes)
        self._entries.clear()

    def _account(self, delta: int) -> None:
        self._bytes += delta
        if self._memory is not None:
            self._memory.nbytes += delta

    def _shrink(self, keep: int = 1, max_bytes: Optional[int] = None) -> None:
        limit = self.max_bytes if max_bytes is None else max_bytes
        while len(self._entries) > keep and (len(self._entries) > self.max_entries or self._bytes > limit):
            _, state = self._entries.popitem(last=False)
            self._account(-state.nbytes)
            self.evictions += 1


class CacheMemory:
    """The connection caches of one replica share one byte bound.

    Every socket's cache is bounded on its own (entries, bytes), but thousands
    of sockets could still add up to more than the replica has. Past
    `max_bytes`, caches are trimmed least recently used connection first: their
    older entries, then (other connections only) their latest one too. The
    cache being written keeps its latest state, so the turn that just ran can
    always be continued; a single state is bounded by `limits.max_context_bytes`.
    """

    def __init__(self, max_entries: int, max_bytes_per_cache: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes_per_cache = max_bytes_per_cache
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.reclaimed = 0  # entries dropped to stay under the replica bound
        self._caches: "weakref.WeakSet[SessionCache]" = weakref.WeakSet()

    def socket_cache(self) -> SessionCache:
        cache = SessionCache(self.max_entries, self.max_bytes_per_cache, memory=self)
        self._caches.add(cache)
        return cache

    def entries(self) -> int:
        return sum(len(c) for c in list(self._caches))

    def reclaim(self, writer: SessionCache) -> None:
        if self.nbytes <= self.max_bytes:
            return
        others = sorted((c for c in list(self._caches) if c is not writer), key=lambda c: c.last_used)
        for keep in (1, 0):  # first their history, then whole idle connections
            for cache in others + ([writer] if keep else []):
                before = len(cache)
                cache._shrink(keep=keep, max_bytes=0)
                self.reclaimed += before - len(cache)
                if self.nbytes <= self.max_bytes:
                    return
