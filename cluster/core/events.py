"""One event assembler for SSE and WebSocket (docs/protocol.md).

Produces the Response object and every stream event as plain JSON-ready dicts
with `sequence_number`s; only the framing (SSE vs WS text frames) differs.
Unit tests check each event against `openai.types.responses.ResponseStreamEvent`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, get_args

from openai.types.responses import ResponseCompletedEvent, ResponseFailedEvent, ResponseIncompleteEvent

from cluster.core.generation import sampling_of
from cluster.protocol.errors import ApiError
from cluster.core.mcp import echoed_tool
from cluster.protocol.ids import new_id

Event = dict[str, Any]  # a stream event as JSON, shaped as `openai.types.responses.ResponseStreamEvent`

# The events that end a response, as the `openai` package names them.
TERMINAL_EVENTS = frozenset(get_args(t.model_fields["type"].annotation)[0]
                            for t in (ResponseCompletedEvent, ResponseIncompleteEvent, ResponseFailedEvent))


def build_response(
    *,
    response_id: str,
    model: str,
    request: Any,
    previous_response_id: Optional[str],
    created_at: Optional[int] = None,
    sampling: Optional[dict[str, float]] = None,
) -> dict[str, Any]:
    """The Response object in status `in_progress`, with every field of docs/protocol.md.
    `sampling`: the model's own defaults (its generation_config), or the turn's `sampling_of`
    already: the response reports the sampling the engine runs."""
    text = request.text.model_dump(exclude_none=True, by_alias=True) if request.text else None
    if not text or "format" not in text:
        text = {"format": {"type": "text"}, **(text or {})}
    response = {
        "id": response_id,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "completed_at": None,
        "status": "in_progress",
        "background": bool(request.background),
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        "previous_response_id": previous_response_id,
        "conversation": {"id": request.conversation_id} if getattr(request, "conversation_id", None) else None,
        "prompt_cache_key": request.prompt_cache_key,
        "reasoning": (request.reasoning.model_dump() if request.reasoning else {"effort": None, "summary": None}),
        "safety_identifier": request.safety_identifier,
        "service_tier": request.service_tier or "default",
        "store": True if request.store is None else request.store,
        "text": text,
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": echo_tools(request.tools),
        "top_logprobs": 0,  # logprobs are not returned: a request asking for them is a 400
        **sampling_of(request, sampling or {}),
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
        "metadata": dict(request.metadata or {}),
    }
    if request.prompt_cache_options is not None:
        # As applied (docs/protocol.md "Prompt caching"): the engine replica keeps the prefix at
        # least `ttl` (up to `engine.kv_budget.ttl_client_max_s`) unless KV pressure ends it sooner.
        response["prompt_cache_options"] = request.prompt_cache_options.model_dump(
            include={"mode", "ttl", "comparison_response_id"})
    return response


def echo_tools(tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The request's tools as the Response object lists them: a function tool always carries
    `description`, `parameters` and `strict` (null when the request left them out), as the
    openai types and the Open Responses schema expect."""
    echoed = []
    for tool in tools or []:
        if tool.get("type") == "function":
            strict = tool.get("strict")
            tool = {**tool, "description": tool.get("description"), "parameters": tool.get("parameters"),
                    "strict": strict if isinstance(strict, bool) else None}
        elif tool.get("type") == "mcp":  # its credentials are never echoed (nor stored: the response holds this)
            tool = echoed_tool(tool)
        echoed.append(tool)
    return echoed


def usage_object(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": input_tokens,
        # cache_write_tokens: the SDK (3.x) models declare it; we report no separate writes.
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


class EventAssembler:
    """Turns parsed engine output into the ordered event stream of one response."""

    @property
    def stream_id(self) -> Optional[str]:
        return self._stream_id

    def __init__(self, response: dict[str, Any], *, stream_id: Optional[str] = None,
                 seal_reasoning: Optional[Callable[[str], str]] = None, first_sequence: int = 0) -> None:
        self.response = response
        # `include: ["reasoning.encrypted_content"]`: each finished reasoning item also carries
        # its text sealed, for a client that keeps no server-side store to send back.
        self._seal_reasoning = seal_reasoning
        self._seq = first_sequence  # 1 after the `response.queued` that announced the response
        self._open: Optional[dict[str, Any]] = None  # the output item being streamed
        self._open_kind: Optional[str] = None
        self._stream_id = stream_id
        self.finished = False

    # -- helpers -------------------------------------------------------------
    def _ev(self, type_: str, **fields: Any) -> Event:
        ev: Event = {"type": type_, "sequence_number": self._seq, **fields}
        if self._stream_id is not None:
            ev["stream_id"] = self._stream_id
        self._seq += 1
        return ev

    def _snapshot(self) -> dict[str, Any]:
        # Events carry a snapshot: later mutation must not change sent events.
        return {**self.response, "output": [_copy_item(i) for i in self.response["output"]]}

    @property
    def output_index(self) -> int:
        return len(self.response["output"]) - 1

    def event(self, type_: str, **fields: Any) -> Event:
        """One more event of this response (an item's own events: cluster/core/turn/mcp_steps.py)."""
        return self._ev(type_, **fields)

    def open_item(self, item: dict[str, Any]) -> list[Event]:
        """A whole item appended to the output (what was open closes first): `output_item.added`."""
        events = self._close_open()
        self.response["output"].append(item)
        return events + [self._ev("response.output_item.added", output_index=self.output_index, item=dict(item))]

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> list[Event]:
        return [
            self._ev("response.created", response=self._snapshot()),
            self._ev("response.in_progress", response=self._snapshot()),
        ]

    def queued(self) -> list[Event]:
        """The response waits for room on its engine replica (KV budget): `response.queued`
        with the status `queued`; `resumed` sends `response.in_progress` when it starts."""
        self.response["status"] = "queued"
        return [self._ev("response.queued", response=self._snapshot())]

    def resumed(self) -> list[Event]:
        if self.response.get("status") != "queued":
            return []
        self.response["status"] = "in_progress"
        return [self._ev("response.in_progress", response=self._snapshot())]

    def text(self, delta: str, *, item_id: Optional[str] = None) -> list[Event]:
        return self._delta("message", "response.output_text.delta", delta, item_id, logprobs=[])

    def reasoning(self, delta: str, *, item_id: Optional[str] = None) -> list[Event]:
        return self._delta("reasoning", "response.reasoning_text.delta", delta, item_id)

    def _delta(self, kind: str, event_type: str, delta: str, item_id: Optional[str], **extra: Any) -> list[Event]:
        if not delta:
            return []
        events = self._ensure_open(kind, item_id)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        events.append(
            self._ev(event_type, item_id=item["id"], output_index=self.output_index, content_index=0, delta=delta, **extra)
        )
        return events

    def compaction(self, item: dict[str, Any]) -> list[Event]:
        """A finished `compaction` item (the turn compacted its context before generating):
        `response.compaction.compacting`, then the item added and done, as OpenAI streams it."""
        events = self._close_open()
        self.response["output"].append(dict(item))
        idx = self.output_index
        events.append(self._ev("response.compaction.compacting", item_id=item["id"], output_index=idx))
        events.append(self._ev("response.output_item.added", output_index=idx, item=dict(item)))
        events.append(self._ev("response.output_item.done", output_index=idx, item=dict(item)))
        return events

    def tool_call(
        self,
        name: str,
        arguments: str,
        *,
        namespace: Optional[str] = None,
        item_id: Optional[str] = None,
        call_id: Optional[str] = None,
    ) -> list[Event]:
        events = self._close_open()
        item: dict[str, Any] = {
            "id": item_id or new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id or new_id("call"),
            "name": name,
            "arguments": "",
        }
        if namespace:
            item["namespace"] = namespace
        self.response["output"].append(item)
        idx = self.output_index
        events.append(self._ev("response.output_item.added", output_index=idx, item=dict(item)))
        events.append(
            self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=arguments)
        )
        item["arguments"] = arguments
        events.append(
            self._ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=idx,
                name=name,
                arguments=arguments,
            )
        )
        item["status"] = "completed"
        events.append(self._ev("response.output_item.done", output_index=idx, item=dict(item)))
        return events

    def finish(
        self,
        usage: dict[str, Any],
        *,
        incomplete_reason: Optional[str] = None,
    ) -> list[Event]:
        events = self._close_open(status="incomplete" if incomplete_reason else "completed")
        self.response["usage"] = usage
        self.response["completed_at"] = int(time.time())
        if incomplete_reason:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": incomplete_reason}
            kind = "response.incomplete"
        else:
            self.response["status"] = "completed"
            kind = "response.completed"
        self.finished = True
        events.append(self._ev(kind, response=self._snapshot()))
        return events

    def add_items(self, items: list[dict[str, Any]]) -> list[Event]:
        """Whole items that were not generated (a multi-agent response's injected tool outputs)."""
        events = self._close_open()
        for item in items:
            item = {"id": new_id("fco"), **item, "status": "completed"}
            self.response["output"].append(item)
            idx = self.output_index
            events.append(self._ev("response.output_item.added", output_index=idx, item=dict(item)))
            events.append(self._ev("response.output_item.done", output_index=idx, item=dict(item)))
        return events

    def discard_output(self) -> None:
        """`response.interrupt` with `discard_partial_items`: the response ends with no output."""
        self.response["output"] = []
        self._open = self._open_kind = None

    def fail(self, error: ApiError, usage: Optional[dict[str, Any]] = None) -> list[Event]:
        """An `error` event, then `response.failed` (docs/protocol.md)."""
        events = self._close_open(status="incomplete")
        err = {
            "status": error.status,
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "error": error.error_object(),
        }
        if error.retry_after_s is not None:
            err["retry_after"] = max(1, round(error.retry_after_s))  # seconds (an HTTP 429's Retry-After)
        events.append(self._ev("error", **err))
        self.response["status"] = "failed"
        self.response["error"] = {"code": error.code or error.type, "message": error.message}
        self.response["usage"] = usage or usage_object(0, 0, 0)
        self.finished = True
        events.append(self._ev("response.failed", response=self._snapshot()))
        return events

    def failed(self, error: dict[str, Any], usage: dict[str, Any]) -> list[Event]:
        """`response.failed` with the error a stored response ended with (no `error` event: a replay)."""
        events = self._close_open()
        self.response.update(status="failed", error=error, usage=usage)
        self.finished = True
        events.append(self._ev("response.failed", response=self._snapshot()))
        return events

    # -- output items --------------------------------------------------------
    def _ensure_open(self, kind: str, item_id: Optional[str] = None) -> list[Event]:
        if self._open_kind == kind and (item_id is None or self._open["id"] == item_id):
            return []
        events = self._close_open()
        if kind == "message":
            item = {"id": item_id or new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        else:
            item = {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        self.response["output"].append(item)
        self._open, self._open_kind = item, kind
        idx = self.output_index
        events.append(self._ev("response.output_item.added", output_index=idx, item=_copy_item(item)))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(
                self._ev(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=dict(part),
                )
            )
        else:
            item["content"].append({"type": "reasoning_text", "text": ""})
        return events

    def _close_open(self, status: str = "completed") -> list[Event]:
        item, kind = self._open, self._open_kind
        if item is None:
            return []
        self._open = self._open_kind = None
        idx = self.response["output"].index(item)
        text = item["content"][0]["text"]
        events: list[Event] = []
        if kind == "message":
            events.append(
                self._ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                self._ev(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=dict(item["content"][0]),
                )
            )
            item["status"] = status
        else:
            events.append(
                self._ev(
                    "response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text
                )
            )
            if self._seal_reasoning is not None:
                item["encrypted_content"] = self._seal_reasoning(text)
        events.append(self._ev("response.output_item.done", output_index=idx, item=_copy_item(item)))
        return events


def _copy_item(item: dict[str, Any]) -> dict[str, Any]:
    if "content" not in item:
        return dict(item)
    return {**item, "content": [dict(p) for p in item["content"]]}


def timing_event(t: Any, stream_id: Optional[str] = None) -> Event:
    """Codex's server-timing event (sent when the upgrade asked with
    `x-responsesapi-include-timing-metrics`; `t` is the turn's TurnTiming): where the turn's
    time went, in ms. "service" is
    the engine replica's own clock; "iapi" is the engine as the API layer saw it (hop included)."""
    ms = lambda s: max(0, round(s * 1000))  # noqa: E731
    iapi_ttft = t.engine_first_token + t.engine_dispatch
    ev: Event = {"type": "responsesapi.websocket_timing", "timing_metrics": {
        "responses_duration_excl_engine_and_client_tool_time_ms": ms(t.total - t.engine - t.tool_wait),
        "engine_service_total_ms": ms(t.engine_inner),
        "engine_iapi_ttft_total_ms": ms(iapi_ttft),
        "engine_service_ttft_total_ms": ms(t.engine_first_token),
        "engine_iapi_tbt_across_engine_calls_ms": ms(t.engine - iapi_ttft),
        "engine_service_tbt_across_engine_calls_ms": ms(t.engine_inner - t.engine_first_token)}}
    if stream_id:
        ev["stream_id"] = stream_id
    return ev
