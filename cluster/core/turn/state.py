"""`ResponseState`: everything the next turn needs from a finished response."""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

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
    request = _size(state.tools) + len(state.instructions or "") + len(state.affinity_key or "")
    if state.response:
        request += _size({k: v for k, v in state.response.items() if k not in _SHARED_WITH_STATE})
    return 256 + tokens + 8 * len(state.items) + state.context_bytes + request


_SHARED_WITH_STATE = frozenset({"output", "tools", "instructions"})


def items_nbytes(items: list[dict[str, Any]]) -> int:
    return sum(_size(item) for item in items)


def _size(value: Any) -> int:
    """Payload bytes of a JSON-like value (strings by length, containers by their members).
    Iterative: a client's nesting depth never reaches Python's recursion limit here."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += 49 + len(v)
        elif isinstance(v, dict):
            total += 64
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            total += 56
            stack.extend(v)
        else:
            total += 24
    return total
