"""Beta multi-agent responses (docs/protocol.md: `multi_agent{enabled}` with the
`OpenAI-Beta: responses_multi_agent=v1` upgrade header): one response runs the agent loop.
When the model calls client-owned tools, the response does not end; it waits for their outputs,
injected with `response.inject`, then generates again with them in its context, all in one
response (its output holds the calls, the injected outputs and what followed).

`AgentInbox` is the plain-logic part: the calls a response emitted, the outputs injected for
them (validated and committed atomically, per `response.inject`), and the wait for a step's
calls to be answered.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from cluster.core.turn.cache import items_nbytes
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import MULTI_AGENT_BETA

BETA = MULTI_AGENT_BETA
# Bytes of injected tool output one connection may hold before its responses take them in: they
# wait outside the frame queue's byte bound (like steers, steering.MAX_STEER_BYTES), so they get
# their own. Taken in, they count against the conversation's `max_context_bytes`.
MAX_INJECTED_BYTES = 16 * 1024 * 1024
OUTPUT_TYPES = {"function_call_output": "function_call"}


class AgentInbox:
    def __init__(self, wait_seconds: float) -> None:
        self.wait_seconds = wait_seconds
        self.calls: dict[str, str] = {}  # call_id -> name: emitted by the model, not yet answered
        self.outputs: dict[str, dict[str, Any]] = {}  # call_id -> its injected output item
        self.nbytes = 0  # what `outputs` holds
        self._changed = asyncio.Event()

    def called(self, call_id: str, name: str) -> None:
        self.calls[call_id] = name

    def offer(self, items: Any, room: Optional[int] = None) -> None:
        """Commit injected tool outputs, all or none (ApiError naming the first bad item, or
        `inject_limit_reached` when they need more than `room` bytes)."""
        if not isinstance(items, list) or not items:
            raise ApiError(400, "response.inject needs a non-empty 'input' array of tool outputs.", param="input",
                           code="invalid_value")
        seen: set[str] = set()
        for n, item in enumerate(items):
            if not isinstance(item, dict) or item.get("type") not in OUTPUT_TYPES:
                raise ApiError(400, f"input[{n}]: response.inject accepts function_call_output items only.",
                               param=f"input[{n}].type", code="invalid_value")
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or call_id not in self.calls:
                raise ApiError(400, f"input[{n}]: the response has no open function call '{call_id}'.",
                               param=f"input[{n}].call_id", code="invalid_value")
            if call_id in self.outputs or call_id in seen:
                raise ApiError(400, f"input[{n}]: the output for '{call_id}' was already injected.",
                               param=f"input[{n}].call_id", code="invalid_value")
            if not isinstance(output, (str, list)):
                raise ApiError(400, f"input[{n}].output must be a string or an array of content parts.",
                               param=f"input[{n}].output", code="invalid_value")
            seen.add(call_id)
        outputs = [{"type": "function_call_output", "call_id": item["call_id"], "output": item["output"]}
                   for item in items]
        size = items_nbytes(outputs)
        if room is not None and size > room:
            raise ApiError(400, f"These tool outputs ({size} bytes) would make this connection hold more than "
                                f"{MAX_INJECTED_BYTES} bytes of injected output not yet taken in; wait for the "
                                "response to take in what it has.", param="input", code="inject_limit_reached")
        for output in outputs:
            self.outputs[output["call_id"]] = output
        self.nbytes += size
        self._changed.set()

    async def collect(self, call_ids: list[str], stop: Optional[asyncio.Event] = None) -> Optional[list[dict]]:
        """The outputs of `call_ids` (in call order) once all are injected; None when the wait
        runs out or `stop` is set first (the response then ends as it stands)."""
        deadline = time.monotonic() + self.wait_seconds
        while not all(c in self.outputs for c in call_ids):
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return None
            self._changed.clear()
            waits = [asyncio.ensure_future(self._changed.wait())]
            if stop is not None:
                waits.append(asyncio.ensure_future(stop.wait()))
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        for c in call_ids:
            self.calls.pop(c, None)
        taken = [self.outputs.pop(c) for c in call_ids]
        self.nbytes -= items_nbytes(taken)
        return taken


def inject_created(response_id: str, stream_id: Optional[str]) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "response.inject.created", "sequence_number": 0, "response_id": response_id}
    if stream_id:
        ev["stream_id"] = stream_id
    return ev


def inject_failed(response_id: str, items: Any, code: str, message: str, stream_id: Optional[str]) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "response.inject.failed", "sequence_number": 0, "response_id": response_id,
                          "input": items, "error": {"code": code, "message": message}}
    if stream_id:
        ev["stream_id"] = stream_id
    return ev
