"""`SessionCache`: bounded LRU of `ResponseState`, per connection or per replica;
`CacheMemory`: one byte bound over all the connection caches of a replica."""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from typing import Iterator, Optional

from cluster.core.turn.state import ResponseState


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
