"""One admission path for every `response.create`, HTTP or WebSocket: the caller's rate limit,
the body parsed and validated once, then the rules that depend on the transport."""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional

from cluster.protocol.errors import ApiError
from cluster.protocol.requests import ResponsesRequest, parse_request

MULTI_AGENT_BETA = "responses_multi_agent=v1"  # the `OpenAI-Beta` value a multi-agent socket sends


def multi_agent_enabled(body: dict[str, Any]) -> bool:
    value = body.get("multi_agent")
    return isinstance(value, dict) and value.get("enabled") is True


def admit_create(body: dict[str, Any], *, transport: Literal["http", "websocket"],
                 admit: Optional[Callable[[], None]], max_input_items: Optional[int],
                 betas: frozenset[str] = frozenset(), parsed: Optional[ResponsesRequest] = None) -> ResponsesRequest:
    """The request, or the ApiError that refuses it. `parsed`: `body` already parsed (a WebSocket
    create parsed to announce its `response.queued`), not parsed again."""
    if admit is not None:
        admit()  # the key's rate limit: every create counts, valid or not
    req = parsed if parsed is not None else parse_request(body, max_input_items=max_input_items)
    multi_agent = multi_agent_enabled(body)
    if transport == "http":
        if multi_agent:  # nothing could inject the outputs a multi-agent response would wait for
            raise ApiError(400, "multi_agent responses run in WebSocket mode (tool outputs come back with "
                                "response.inject).", param="multi_agent", code="unsupported_value")
        if req.background and req.stream:
            raise ApiError(400, "background responses cannot be streamed here; poll GET /v1/responses/{id}.",
                           param="stream", code="unsupported_value")
    else:
        if multi_agent and MULTI_AGENT_BETA not in betas:
            raise ApiError(400, f"multi_agent needs the 'OpenAI-Beta: {MULTI_AGENT_BETA}' header on the WebSocket "
                                "upgrade.", param="multi_agent", code="invalid_value")
        if req.background:
            raise ApiError(400, "background is not supported in websocket mode.", param="background",
                           code="invalid_value")
    return req
