"""The ingress's routes: plain FastAPI functions that reach the replica through a dependency.

Why not methods on the deployment class: Ray Serve's class-based-view rewrite
(`@serve.ingress(app)` turning `self` into a dependency) breaks with FastAPI
>= 0.137 (ray-project/ray#64475: `self` becomes a required query parameter and
every route answers 400). Functions with `Depends(replica)` need no rewrite, so
they work with every FastAPI the pyproject allows. One ConnectionActor lives in
each replica process; `bind` registers its services when it starts. (Not `app.state`: Serve
pickles the ingress app into each replica, so the app the requests reach is a copy the
constructor cannot see without Serve's private attributes.)
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import TYPE_CHECKING, Any, Optional

from fastapi import Depends, Request, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.websockets import WebSocketDisconnect

from actors.http import app, error_response, json_body, peak_rss_bytes, rss_bytes, sse
from cluster import telemetry
from cluster.core.messages import TurnProgress
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.turn import TurnRequest, cache_salt
from cluster.core.websocket.session import WebSocketSession
from cluster.protocol import ids
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.requests import admit_create, session_header

if TYPE_CHECKING:  # pragma: no cover
    from cluster.serving.connection import ConnectionServices

_replica: Optional["ConnectionServices"] = None


def bind(services: "ConnectionServices") -> None:
    global _replica
    _replica = services


def replica() -> "ConnectionServices":
    if _replica is None:  # a request before the constructor finished: Serve does not route those
        raise ApiError(503, "The server is starting.", code="server_starting", type="server_error")
    return _replica


Conn = Depends(replica)


# -- operational ----------------------------------------------------------------
@app.get("/health")
async def health(conn: "ConnectionServices" = Conn) -> JSONResponse:
    """Ready only when every deployment a turn needs answers (not just this ingress). Reveals nothing else."""
    try:
        await conn.health()
    except Exception:
        return JSONResponse({"status": "starting"}, status_code=503)
    return JSONResponse({"status": "ok"})


@app.get("/loopserve/stats")
async def stats(request: Request, last: int = 200, engine_session: Optional[str] = None,
                conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    """Counters and per-turn timings of every tenant: admin key only. `engine_session`
    picks the engine replica that session key routes to (else any one)."""
    conn.auth.authenticate_admin(request.headers.get("authorization"))
    figures = await conn.stats(last, ids.session_key(engine_session) if engine_session else None, rss_bytes())
    # pid: which process answered (a replica Serve replaced answers with another one)
    return {**figures, "peak_rss_bytes": peak_rss_bytes(), "pid": os.getpid()}


@app.websocket("/loopserve/echo")
async def echo(ws: WebSocket, conn: "ConnectionServices" = Conn) -> None:
    """Echoes frames: the latency floor of a WebSocket through the same ingress (benchmarks).

    Off unless `ops.echo_route`; then admin key, Origin check, the per-key
    connection limit, the frame limit and the idle/lifetime limits apply."""
    if not conn.config.ops.echo_route:
        await conn.deny(ws, ApiError(404, "Not Found", code="not_found"))
        return
    try:
        conn.check_origin(ws)
        conn.auth.authenticate_admin(ws.headers.get("authorization"))
    except ApiError as err:
        await conn.deny(ws, err)
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
                await ws.send_text(json.dumps(conn.frame_too_large(len(data)).ws_event()))
                continue
            await ws.send_text(data if isinstance(data, str) else data.decode("utf-8", "replace"))
    except (asyncio.TimeoutError, WebSocketDisconnect, RuntimeError):
        pass
    try:
        await ws.close(code=1000)
    except RuntimeError:
        pass


# -- the Responses API ------------------------------------------------------------
@app.get("/v1/models")
async def models(request: Request, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    conn.principal(request)
    name = conn.config.model.name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "loopserve"}]}


@app.post("/v1/responses/input_tokens")
async def input_tokens(request: Request, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    p = conn.principal(request)
    conn.auth.admit_request(p)  # it renders the whole input: admitted like a create
    return await conn.responses.input_tokens(await json_body(request, conn.config.limits.max_request_bytes), p.tenant)


@app.post("/v1/responses/compact")
async def compact(request: Request, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    p = conn.principal(request)
    conn.auth.admit_request(p)
    return await conn.responses.compact(await json_body(request, conn.config.limits.max_request_bytes), p.tenant)


@app.get("/v1/responses/{response_id}/input_items")
async def input_items(request: Request, response_id: str, after: Optional[str] = None, limit: int = 20,
                      order: str = "desc", conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    p = conn.principal(request)
    return await conn.responses.input_items(response_id, p.tenant, after=after, limit=limit, order=order)


@app.post("/v1/responses/{response_id}/cancel")
async def cancel(request: Request, response_id: str, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    return await conn.responses.cancel(response_id, conn.principal(request).tenant)


@app.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str, conn: "ConnectionServices" = Conn) -> dict[str, Any]:
    return await conn.responses.delete(response_id, conn.principal(request).tenant)


@app.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str, stream: bool = False, starting_after: Optional[int] = None,
                   conn: "ConnectionServices" = Conn):
    p = conn.principal(request)
    if stream:
        events = await conn.responses.replay(response_id, p.tenant, starting_after)

        async def replay():
            for ev in events:
                yield sse(ev)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(replay(), media_type="text/event-stream")
    return JSONResponse(await conn.responses.retrieve(response_id, p.tenant))


@app.post("/v1/responses")
async def create(request: Request, conn: "ConnectionServices" = Conn):
    received_at = time.perf_counter()
    try:
        p = conn.principal(request)
        body = await json_body(request, conn.config.limits.max_request_bytes)
        req = admit_create(body, transport="http", admit=lambda: conn.auth.admit_request(p),
                           max_input_items=conn.config.limits.max_input_items)
        parsed_at = time.perf_counter()
        session_key = ids.session_key(session_header(request.headers) or req.prompt_cache_key
                                      or req.previous_response_id)
        if req.background:
            return JSONResponse(conn.responses.start_background(req, p.tenant, session_key))
    except ApiError as err:
        return error_response(err)
    events = conn.driver.run(TurnRequest(
        req,
        SessionCache(1),  # HTTP has no connection: state goes to the registry
        session_key=session_key,
        lookup=conn.responses.lookup_for(p.tenant),
        on_state=conn.responses.remember,
        owner=p.tenant,
        received_at=received_at,
        parsed_at=parsed_at,
        trace_parent=telemetry.extract_headers(request.headers),
        transport="http",
    ))
    try:
        first = await events.__anext__()
    except ApiError as err:
        return error_response(err)
    if req.stream:
        return StreamingResponse(_sse_stream(first, events), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    progress = TurnProgress()
    progress.observe(first)
    async for ev in events:
        progress.observe(ev)
    if progress.final is None:
        return error_response(server_error())
    error = progress.error
    if progress.status == "failed" and error is not None:
        e = error["error"]
        return error_response(ApiError(error.get("status", 500), e["message"], code=e.get("code"), param=e.get("param")))
    return JSONResponse(progress.final)


async def _sse_stream(first: dict[str, Any], events):
    try:
        yield sse(first)
        async for ev in events:
            yield sse(ev)
        yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()  # client gone mid-stream: cancels the engine call


@app.websocket("/v1/responses")
async def websocket(ws: WebSocket, conn: "ConnectionServices" = Conn) -> None:
    if conn.draining:
        await conn.deny(ws, ApiError(503, "This server is shutting down; connect again.", code="server_draining",
                                     type="server_error"))
        return
    try:
        conn.check_origin(ws)
        named_session = session_header(ws.headers)
        p = conn.auth.authenticate(ws.headers.get("authorization"))
        conn.auth.open_connection(p)
    except ApiError as err:
        await conn.deny(ws, err)  # before the upgrade: a plain HTTP error
        return
    # Codex reads the server's frame limit from the upgrade response (docs/protocol.md).
    limit = str(conn.config.websocket.max_frame_bytes).encode()
    await ws.accept(headers=[(b"x-codex-websocket-max-message-bytes", limit)])
    conn.metrics.socket_opened()
    lock = asyncio.Lock()

    async def send(event: dict[str, Any]) -> None:
        async with lock:
            await ws.send_text(json.dumps(event, separators=(",", ":")))

    async def close(code: int, reason: str) -> None:
        async with lock:
            await ws.close(code=code, reason=reason)

    stored = False  # a closed socket whose responses were all `store: false` frees its engine KV at once

    def remember(state) -> None:
        nonlocal stored
        stored = stored or state.store
        conn.responses.remember(state)

    session = WebSocketSession(
        conn.driver,
        conn.memory.socket_cache(),
        session_key=ids.session_key(named_session),
        config=conn.config.websocket,
        send=send,
        close=close,
        lookup=conn.responses.lookup_for(p.tenant),
        on_state=remember,
        owner=p.tenant,
        admit=lambda: conn.auth.admit_request(p),
        trace_parent=telemetry.extract_headers(ws.headers),
        timing_metrics=ws.headers.get("x-responsesapi-include-timing-metrics", "").lower() in ("1", "true"),
        betas=frozenset(b.strip() for b in ws.headers.get("openai-beta", "").split(",") if b.strip()),
        settle=conn.settle_responses,
    )
    session.start()
    conn.ws_sessions.add(session)
    if conn.draining:
        await session.drain()
    try:
        while not session.closed:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                break
            data = msg.get("text")
            if data is None:
                data = msg.get("bytes") or b""
            await session.on_frame(data)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        conn.metrics.socket_closed()
        conn.ws_sessions.discard(session)
        conn.auth.close_connection(p)
        await session.shutdown()
        if not stored:
            await conn.engine.release(session.session_key, cache_salt(p.tenant))
