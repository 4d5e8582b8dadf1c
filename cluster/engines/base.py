"""The engine interface: prompt token ids in, text deltas out."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Protocol


@dataclass
class EngineRequest:
    request_id: str
    session_key: str
    prompt_token_ids: array  # array('i')
    max_tokens: int
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    # Function specs offered to the model, and what kind of item ends the
    # context (the scripted engine decides between a tool call and an answer).
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    last_item: str = "user"  # user | tool | assistant | none


@dataclass
class EngineDelta:
    text: str = ""
    new_tokens: int = 0
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | abort
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class EngineStats:
    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    sessions: set = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "aborted": self.aborted,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "sessions": len(self.sessions),
        }


class Engine(Protocol):
    stats: EngineStats
    max_model_len: int

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...
