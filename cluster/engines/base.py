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
    pieces: int = 0  # output pieces handed back (a streamed token each, fewer when gathered)
    # Recently seen session keys, bounded: a stateless client brings a new key per request.
    sessions: "RecentKeys" = field(default_factory=lambda: RecentKeys(4096))

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "aborted": self.aborted,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "pieces": self.pieces,
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


@dataclass(frozen=True)
class KvFacts:
    """What an engine says about its KV cache once started: what the replica's KV budget
    (engines/kv/admission.py) is sized and timed by."""

    capacity_tokens: int  # 0: not known (nothing to budget)
    block_size: int
    # What the budget weighs an ended retention by: a tier below the engine's own KV reloads at
    # this rate (None: no tier, the prefix is computed again).
    lower_tier_tokens_per_s: Optional[float]


class Engine(Protocol):
    """Everything `EngineReplica` uses of its engine (vLLM's AsyncLLM, the scripted engine)."""

    stats: EngineStats
    max_model_len: int
    # Why a retained session's blocks are not pinned in the engine ("" when they are).
    pins_off_reason: str

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...

    async def check_health(self) -> None:
        """Raises when the engine cannot serve (Serve restarts the replica)."""

    def kv_facts(self) -> KvFacts: ...

    def kv_in_use_tokens(self) -> Optional[int]:
        """Tokens of KV the engine itself holds (blocks referenced), when it says (None: unknown)."""

    def kv_stats(self) -> dict[str, Any]:
        """The engine's own KV figures for `/loopserve/stats` (its preemptions; a modelled pool's)."""

    def grammar_worker(self) -> Optional[dict[str, Any]]:
        """The structured-output compile worker's state, when the engine runs one."""
