"""The API's error shapes: HTTP body, SSE `error` event and WebSocket error event."""

from __future__ import annotations

from typing import Any, Optional

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    426: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


def _rebuild_api_error(status: int, message: str, code: Optional[str], param: Optional[str],
                       type: Optional[str], retry_after_s: Optional[float] = None) -> "ApiError":
    return ApiError(status, message, code=code, param=param, type=type, retry_after_s=retry_after_s)


class ApiError(Exception):
    """An error the client is told about, in the API's own shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: Optional[str] = None,
        param: Optional[str] = None,
        type: Optional[str] = None,
        retry_after_s: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # an HTTP 429's Retry-After
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def __reduce__(self):
        # Picklable across a Ray handle (a render replica's 400 reaches the client as a 400).
        return (_rebuild_api_error, (self.status, self.message, self.code, self.param, self.type, self.retry_after_s))

    def error_object(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def http_body(self) -> dict[str, Any]:
        return {"error": self.error_object()}

    def ws_event(self) -> dict[str, Any]:
        return {"type": "error", "status": self.status, "error": self.error_object()}

    def sse_event(self, sequence_number: int) -> dict[str, Any]:
        # Our choice (docs/protocol.md): both the flat and the wrapped shape at once.
        return {
            "type": "error",
            "sequence_number": sequence_number,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "error": self.error_object(),
        }

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.code!r}, {self.message!r})"


def invalid_request(message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code or "invalid_value" if param else code)


def previous_response_not_found(response_id: str) -> ApiError:
    return ApiError(
        400,
        f"Previous response with id '{response_id}' not found.",
        code="previous_response_not_found",
        param="previous_response_id",
    )


def server_error(message: str = "The server had an error while processing your request.") -> ApiError:
    return ApiError(500, message, code="server_error")


def from_validation_error(exc: Any) -> ApiError:
    """A pydantic ValidationError as one 400, naming the first bad parameter."""
    errors = exc.errors(include_url=False)
    if not errors:
        return invalid_request("Invalid request body.")
    # With unions (`input`: str | list), the deepest location is the real culprit.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = loc_to_param(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    return ApiError(400, f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


def loc_to_param(loc: tuple) -> str:
    """('input', 0, 'call_id') -> 'input[0].call_id'; drops pydantic's union tags."""
    out = ""
    prev = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            prev = part
        elif isinstance(part, str) and (part == "str" or part.startswith(("function-", "tagged-", "union[", "list["))):
            continue
        elif isinstance(part, str) and part in _TAGS and isinstance(prev, int):
            prev = part
            continue  # a union member's tag, not a field name
        else:
            out += ("." if out else "") + str(part)
        prev = part
    return out or "body"


_TAGS = {
    "message", "function_call", "function_call_output", "reasoning", "compaction",
    "item_reference", "str", "list[...]", "input_text", "output_text",
}
