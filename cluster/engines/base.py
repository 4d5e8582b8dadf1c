"""The engine interface: prompt token ids in (`EngineRequest`, whole prompt), text deltas out."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Protocol

from cluster.core.messages import CoreTimeline, EngineRequest


@dataclass
class EngineDelta:
    text: str = ""
    new_tokens: int = 0
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | abort
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the new tokens themselves
    core: Optional[CoreTimeline] = None  # on the last delta, from engines that mark their core's steps


@dataclass
class EngineStats:
    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    # Recently seen session keys, bounded: a stateless client brings a new key per request.
    sessions: "RecentKeys" = field(default_factory=lambda: RecentKeys(4096))

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "aborted": self.aborted,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "sessions": len(self.sessions),  # of the last `sessions.limit` requests' keys
        }


class RecentKeys:
    """An insertion-ordered set holding at most `limit` keys (the oldest go first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


class Engine(Protocol):
    stats: EngineStats
    max_model_len: int

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...
