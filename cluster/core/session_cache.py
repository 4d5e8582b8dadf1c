"""`SessionCache`: bounded LRU of `ResponseState`, per connection or per replica."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Optional

from .state import ResponseState


class SessionCache:
    """LRU bounded by entries and bytes; never evicts the most recent response.

    Keeping the latest one even when it alone exceeds the byte bound is what
    makes the next turn of an agent loop a cache hit (PROTOCOL §5).
    """

    def __init__(self, max_entries: int = 64, max_bytes: int = 256 * 1024 * 1024) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, ResponseState] = OrderedDict()
        self._bytes = 0
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
        self.hits += 1
        return state

    def put(self, state: ResponseState) -> None:
        old = self._entries.pop(state.response_id, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._entries[state.response_id] = state
        self._bytes += state.nbytes
        self._shrink()

    def evict(self, response_id: str) -> bool:
        state = self._entries.pop(response_id, None)
        if state is None:
            return False
        self._bytes -= state.nbytes
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _shrink(self) -> None:
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_entries or self._bytes > self.max_bytes
        ):
            _, state = self._entries.popitem(last=False)
            self._bytes -= state.nbytes
            self.evictions += 1
