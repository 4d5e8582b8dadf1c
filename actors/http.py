"""The ingress's HTTP plumbing: a FastAPI app with error handlers in the API's error
shape, bounded JSON bodies, SSE framing. Routes live in `actors/routes.py`."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.protocol.errors import ApiError, loc_to_param, server_error
from cluster.protocol.request_bounds import json_bounds

log = logging.getLogger("loopserve.connection")


def new_app() -> FastAPI:
    """An app that answers every error in the API's error shape, with no generated docs or schema
    on the public port."""
    app = FastAPI(title="loopserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
    return app


BODY_READ = "loopserve.body_read"  # set in the request's scope once `json_body` starts reading
LINGER_BYTES = 64 * 1024  # an unread body past this is not read to be thrown away


def error_response(err: ApiError, request: Optional[Request] = None) -> JSONResponse:
    """The API's error shape. A request refused before its body was read (a 401, 413 or 429 on a
    POST) whose body is large, or of unknown length, gets `Connection: close`: otherwise the server
    reads the rest of it (13.6 MB, again and again for a client over its rate limit) only to
    discard it, on the event loop every client shares."""
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(err.retry_after_s)))
    if request is not None and _unread_body_is_large(request):
        headers["connection"] = "close"
    return JSONResponse(err.http_body(), status_code=err.status, headers=headers or None)


def _unread_body_is_large(request: Request) -> bool:
    if request.method != "POST" or request.scope.get(BODY_READ):
        return False
    declared = request.headers.get("content-length")
    if declared is None:
        return "chunked" in request.headers.get("transfer-encoding", "").lower()
    return not declared.isdigit() or int(declared) > LINGER_BYTES


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc, request)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, str(exc.detail), code=code))


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A bad path or query parameter, named as the client wrote it (`limit`, not the handler's argument)."""
    first = (exc.errors() or [{}])[0]
    loc = tuple(first.get("loc", ()))
    param = loc_to_param(loc[1:] if loc and loc[0] in ("query", "path", "header", "body") else loc)
    if first.get("type") == "missing":
        return error_response(ApiError(400, f"Missing required parameter: '{param}'.", param=param,
                                        code="missing_required_parameter"))
    return error_response(ApiError(400, f"Invalid value for '{param}': {first.get('msg', 'invalid')}.",
                                    param=param, code="invalid_value"))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return error_response(server_error())


async def deny(ws: WebSocket, err: ApiError) -> None:
    """Refuses a WebSocket before the upgrade with the error as a plain HTTP response."""
    try:
        await ws.send_denial_response(JSONResponse(err.http_body(), status_code=err.status))
    except Exception:  # the server does not support denial responses: refuse the upgrade
        await ws.close(code=1008, reason=err.message[:120])


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def declared_bytes(request: Request) -> int:
    """A request's Content-Length (0 when it has none: chunked)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else 0


async def json_body(request: Request, limit: int = 16 * 1024 * 1024,
                    charge: Optional[Callable[[int], None]] = None) -> Any:
    """The parsed body, at most `limit` bytes, nesting at most MAX_JSON_DEPTH; `charge` is told its size once read."""
    declared = declared_bytes(request)
    if declared > limit:
        raise _too_large(declared, limit)
    request.scope[BODY_READ] = True
    body = bytearray()
    async for chunk in request.stream():  # chunked bodies are bounded too
        body += chunk
        if len(body) > limit:
            request.scope[BODY_READ] = False  # the rest is not read either
            raise _too_large(len(body), limit)
    if charge is not None:
        charge(len(body))
    too_complex, _ = json_bounds(body)  # containers and nesting, before the parse, which holds the event loop
    if too_complex is not None:
        raise too_complex
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # invalid UTF-8, nesting deeper than the parser goes
        raise ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json") from None


def peak_rss_bytes() -> Optional[int]:
    """This process's peak resident memory since it started (Linux VmHWM): what a burst cost."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def rss_bytes() -> Optional[int]:
    """This process's resident memory (Linux), for memory-per-session measurements."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"The request body is {size} bytes or more; the limit is {limit} bytes.",
                    code="request_too_large")
