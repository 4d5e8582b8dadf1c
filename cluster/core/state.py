"""`ResponseState`: everything the next turn needs from a finished response."""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class RenderKey:
    """What a rendered token prefix depends on besides the items themselves."""

    instructions: Optional[str]
    tools_json: str  # canonical JSON of the normalized tools

    @classmethod
    def of(cls, instructions: Optional[str], tools: list[dict[str, Any]]) -> "RenderKey":
        return cls(instructions, json.dumps(tools, sort_keys=True, separators=(",", ":")))


@dataclass
class RenderedPrefix:
    """Token ids of the chat-template render of `items[:item_count]` (no generation prompt)."""

    key: RenderKey
    item_count: int
    token_ids: array  # array('i'): compact, cheap to copy and to pickle
    # Index into items where the last rendered chat message starts: the anchor
    # that the next delta render is rendered after.
    anchor_start: int


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
    nbytes: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = estimate_nbytes(self)


def estimate_nbytes(state: ResponseState) -> int:
    """Rough memory cost, for the byte bound of the cache (not exact, but monotone)."""
    tokens = len(state.rendered.token_ids) * 4 if state.rendered else 0
    # Items are shared with ancestors; count their pointers, plus our own payload.
    own = sum(_item_size(item) for item in state.items[state.output_start :])
    return 256 + tokens + 8 * len(state.items) + own


def _item_size(item: dict[str, Any]) -> int:
    size = 64
    for value in item.values():
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, list):
            size += sum(len(p.get("text") or "") + 32 if isinstance(p, dict) else 32 for p in value)
    return size
