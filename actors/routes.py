"""The ingress's routes: plain FastAPI functions on a router; each replica builds its own app
from them (`build_app`) with its services in `app.state`, as vLLM's entrypoints do.

The app is built in the replica, after the constructor (`ConnectionActor.__serve_build_asgi_app__`,
Serve's late-bound ingress), not passed to `@serve.ingress(app)`: Serve pickles a passed app into
each replica, so the app the requests reach would be a copy the constructor cannot put its state
on. Not methods on the deployment class either: Serve's class-based-view rewrite breaks with
FastAPI >= 0.137 (ray-project/ray#64475: `self` becomes a required query parameter and every route
answers 400).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import TYPE_CHECKING, Any, Optional

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import HTTPConnection
from starlette.websockets import WebSocketDisconnect

from actors import client_socket
from actors.http import declared_bytes, deny, error_response, json_body, new_app, peak_rss_bytes, rss_bytes, sse
from cluster.auth import ANONYMOUS
from cluster.protocol import ids
from cluster.protocol.errors import ApiError
from cluster.serving.turns import StreamedTurn

if TYPE_CHECKING:  # pragma: no cover
    from cluster.serving.connection import ConnectionServices

router = APIRouter()


def build_app(services: "ConnectionServices") -> FastAPI:
    """One replica's app: the routes below, reaching `services` through `app.state`."""
    app = new_app()
    app.state.services = services
    app.include_router(router)
    return app


async def replica(connection: HTTPConnection) -> "ConnectionServices":
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop on every
    # request and WebSocket (11% of a loaded replica's event loop, measured under the adversarial run)
    return connection.app.state.services


Conn = Depends(replica)


# -- operational ----------------------------------------------------------------
@router.get("/health")
async def health(conn: "ConnectionServices" = Conn) -> JSONResponse:
    """Ready only when every deployment a turn needs answers (not just this ingress). Reveals nothing else."""
    starting = await conn.not_ready()
    if starting is not None:
        return JSONResponse({"status": "starting"}, status_code=503,
                            headers={"retry-after": str(int(starting.retry_after_s or 1))})
    return JSONResponse({"status": "ok"})


@router.get("/loopserve/stats")
async def stats(request: Request, last: int = 200, engine_session: Optional[str] = None,
                engine_tenant: str = ANONYMOUS.tenant, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    """Counters and per-turn timings of every tenant: admin key only. `engine_session` (of
    `engine_tenant`'s, the keyless one's by default: session keys are per tenant) picks the engine
    replica that session routes to (else any one)."""
    conn.auth.authenticate_admin(request.headers.get("authorization"))
    key = ids.session_key(engine_session, engine_tenant) if engine_session else None
    figures = await conn.stats(last, key, rss_bytes())
    # pid: which process answered (a replica Serve replaced answers with another one)
    return {**figures, "peak_rss_bytes": peak_rss_bytes(), "pid": os.getpid()}


@router.websocket("/loopserve/echo")
async def echo(ws: WebSocket, conn: "ConnectionServices" = Conn) -> None:
    """Echoes frames: the latency floor of a WebSocket through the same ingress (benchmarks).

    Off unless `ops.echo_route`; then admin key, Origin check, the per-key
    connection limit, the frame limit and the idle/lifetime limits apply."""
    if not conn.config.ops.echo_route:
        await deny(ws, ApiError(404, "Not Found", code="not_found"))
        return
    try:
        conn.turns.check_origin(ws.headers.get("origin"))
        conn.auth.authenticate_admin(ws.headers.get("authorization"))
    except ApiError as err:
        await deny(ws, err)
        return
    cfg = conn.config.websocket
    await ws.accept()
    deadline = time.monotonic() + cfg.max_connection_seconds
    try:
        while True:
            timeout = min(cfg.idle_timeout_seconds, deadline - time.monotonic())
            if timeout <= 0:
                break
            msg = await asyncio.wait_for(ws.receive(), timeout)
            if msg["type"] == "websocket.disconnect":
                return
            data = msg.get("text") if msg.get("text") is not None else msg.get("bytes") or b""
            if len(data) > cfg.max_frame_bytes:
                data = json.dumps(conn.frame_too_large(len(data)).ws_event())
            await client_socket.send_text(ws, data if isinstance(data, str) else data.decode("utf-8", "replace"),
                                          cfg.send_stall_seconds)
    except (asyncio.TimeoutError, WebSocketDisconnect, RuntimeError):
        pass
    try:
        await client_socket.close(ws, 1000, "", cfg.send_stall_seconds)
    except (RuntimeError, OSError, WebSocketDisconnect):  # gone, or cut
        pass


# -- the Responses API ------------------------------------------------------------
@router.get("/v1/models")
async def models(request: Request, conn: "ConnectionServices" = Conn) -> Any:
    conn.principal(request.headers)
    # A model is listed once a turn can run on it: clients (and probes) read this as readiness, and
    # a listed model whose engine still loaded held the first request ~100 s.
    starting = await conn.not_ready()
    if starting is not None:
        return error_response(starting, request)
    name = conn.config.model.name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "loopserve"}]}


async def admitted_body(request: Request, conn: "ConnectionServices", p, optional: bool = False) -> Any:
    """A create's body, admitted before it is read and parsed: every create counts, valid or not,
    with the bytes it declares; one that came chunked is charged to the key's input bytes as read.
    `optional`: an empty body is none (`POST /v1/conversations` may send nothing)."""
    declared = declared_bytes(request)
    conn.auth.admit_request(p, declared)
    if optional and declared == 0 and "transfer-encoding" not in request.headers:
        return None
    return await json_body(request, conn.config.limits.max_request_bytes,
                           charge=None if declared else lambda n: conn.auth.charge_input(p, n))


@router.post("/v1/responses/input_tokens")
async def input_tokens(request: Request, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    p = conn.principal(request.headers)
    # It renders the whole input: admitted like a create.
    return await conn.responses.input_tokens(await admitted_body(request, conn, p), p.tenant)


@router.post("/v1/responses/compact")
async def compact(request: Request, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    p = conn.principal(request.headers)
    return await conn.responses.compact(await admitted_body(request, conn, p), p.tenant)


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(request: Request, response_id: str, after: Optional[str] = None, limit: int = 20,
                      order: str = "desc", conn: "ConnectionServices" = Conn) -> JSONResponse:
    p = conn.read_principal(request.headers)
    return conn.read(p, JSONResponse(await conn.responses.input_items(response_id, p.tenant, after=after,
                                                                      limit=limit, order=order)))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(request: Request, response_id: str, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    return await conn.responses.cancel(response_id, conn.read_principal(request.headers).tenant)


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    return await conn.responses.delete(response_id, conn.read_principal(request.headers).tenant)


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str, stream: bool = False, starting_after: Optional[int] = None,
                   conn: "ConnectionServices" = Conn):
    p = conn.read_principal(request.headers)
    if stream:
        chunks = [sse(ev) for ev in await conn.responses.replay(response_id, p.tenant, starting_after)]
        conn.auth.charge_read(p, sum(map(len, chunks)))

        async def replay():
            for chunk in chunks:
                yield chunk
            yield b"data: [DONE]\n\n"

        return StreamingResponse(replay(), media_type="text/event-stream")
    return conn.read(p, JSONResponse(await conn.responses.retrieve(response_id, p.tenant)))


# -- Conversations ----------------------------------------------------------------
@router.post("/v1/conversations")
async def conversation_create(request: Request, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    p = conn.principal(request.headers)
    return await conn.conversations.create(await admitted_body(request, conn, p, optional=True), p.tenant)


@router.get("/v1/conversations/{conversation_id}")
async def conversation_retrieve(request: Request, conversation_id: str, conn: "ConnectionServices" = Conn):
    p = conn.read_principal(request.headers)
    return conn.read(p, JSONResponse(await conn.conversations.retrieve(conversation_id, p.tenant)))


@router.post("/v1/conversations/{conversation_id}")
async def conversation_update(request: Request, conversation_id: str, conn: "ConnectionServices" = Conn):
    p = conn.principal(request.headers)
    return await conn.conversations.update(conversation_id, await admitted_body(request, conn, p), p.tenant)


@router.delete("/v1/conversations/{conversation_id}")
async def conversation_delete(request: Request, conversation_id: str, conn: "ConnectionServices" = Conn):
    return await conn.conversations.delete(conversation_id, conn.read_principal(request.headers).tenant)


@router.post("/v1/conversations/{conversation_id}/items")
async def conversation_items_create(request: Request, conversation_id: str, conn: "ConnectionServices" = Conn):
    p = conn.principal(request.headers)
    return await conn.conversations.add_items(conversation_id, await admitted_body(request, conn, p), p.tenant)


@router.get("/v1/conversations/{conversation_id}/items")
async def conversation_items(request: Request, conversation_id: str, after: Optional[str] = None, limit: int = 20,
                             order: str = "desc", conn: "ConnectionServices" = Conn) -> JSONResponse:
    p = conn.read_principal(request.headers)
    page = await conn.conversations.list_items(conversation_id, p.tenant, after=after, limit=limit, order=order)
    return conn.read(p, JSONResponse(page))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def conversation_item(request: Request, conversation_id: str, item_id: str, conn: "ConnectionServices" = Conn):
    p = conn.read_principal(request.headers)
    return conn.read(p, JSONResponse(await conn.conversations.get_item(conversation_id, item_id, p.tenant)))


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def conversation_item_delete(request: Request, conversation_id: str, item_id: str,
                                   conn: "ConnectionServices" = Conn):
    p = conn.read_principal(request.headers)
    return await conn.conversations.delete_item(conversation_id, item_id, p.tenant)


@router.post("/v1/responses")
async def create(request: Request, conn: "ConnectionServices" = Conn):
    received_at = time.perf_counter()
    try:
        p = conn.principal(request.headers)
        body = await admitted_body(request, conn, p)
        turn = await conn.turns.create(body, p, request.headers, received_at)
    except ApiError as err:
        return error_response(err, request)
    if isinstance(turn, StreamedTurn):
        return StreamingResponse(_sse_stream(turn), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    return JSONResponse(turn)


async def _sse_stream(turn: StreamedTurn):
    try:
        yield sse(turn.first)
        async for ev in turn.rest:
            yield sse(ev)
        yield b"data: [DONE]\n\n"
    finally:
        await turn.rest.aclose()  # client gone mid-stream: cancels the engine call


@router.websocket("/v1/responses")
async def websocket(ws: WebSocket, conn: "ConnectionServices" = Conn) -> None:
    try:
        p = conn.turns.admit_socket(ws.headers)
    except ApiError as err:
        await deny(ws, err)  # before the upgrade: a plain HTTP error
        return
    # Codex reads the server's frame limit from the upgrade response (docs/protocol.md).
    limit = str(conn.config.websocket.max_frame_bytes).encode()
    try:
        await ws.accept(headers=[(b"x-codex-websocket-max-message-bytes", limit)])
    except Exception:  # the client left during the upgrade: its connection no longer counts
        conn.turns.abandon_socket(p)
        raise
    lock = asyncio.Lock()
    stall_s = conn.config.websocket.send_stall_seconds

    async def send(event: dict[str, Any]) -> None:
        async with lock:
            await client_socket.send_text(ws, json.dumps(event, separators=(",", ":")), stall_s)

    async def close(code: int, reason: str) -> None:
        async with lock:
            await client_socket.close(ws, code, reason, stall_s)

    socket = await conn.turns.open_socket(p, ws.headers, send, close)
    try:
        while not socket.session.closed:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                break
            data = msg.get("text")
            if data is None:
                data = msg.get("bytes") or b""
            await socket.session.on_frame(data)
            # A frame already buffered is returned without a suspension: without this, a socket
            # with a burst of frames (64 creates of 300 KB) holds the event loop until its buffer
            # is empty, and every other socket's turn waits behind it (4 s, measured). One frame
            # a socket per pass of the loop, round robin.
            await asyncio.sleep(0)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        await conn.turns.close_socket(socket)
