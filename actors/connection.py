"""ConnectionActor: the Serve ingress (FastAPI), HTTP + SSE and WebSocket routes.

Owns one `SessionCache` per WebSocket connection, a replica-wide cache of
`store: true` responses, the durable store, auth and per-key limits. Turns are
driven by the shared `TurnDriver`; render, engine and safety are reached
through handles. Routes are thin: the logic lives in `cluster.serving`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.websockets import WebSocketDisconnect

from opentelemetry import context as otel_context

from actors.drain import DrainWatch
from actors.http import app, error_response, json_body, rss_bytes, sse
from cluster import telemetry
from cluster.auth import Authenticator, Principal
from cluster.config import LoopserveConfig
from cluster.core.render import render_job
from cluster.core.post_work import OutputTailCheck, PostWorkQueue, SafetyLedger, UsageMeter, load_hook
from cluster.core.session_cache import SessionCache
from cluster.core.turn import TurnDriver
from cluster.core.ws_session import WebSocketSession
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.requests import parse_request
from cluster.serving.responses import ResponsesService
from cluster.store import open_store
from cluster.tokenizer import load_tokenizer, renderer_for

log = logging.getLogger("loopserve.connection")

@serve.deployment(name="ConnectionActor")
@serve.ingress(app)
class ConnectionActor:
    async def __init__(
        self,
        render: DeploymentHandle,
        engine: DeploymentHandle,
        config: LoopserveConfig,
        safety: Optional[DeploymentHandle] = None,
    ) -> None:
        self.config = config
        telemetry.setup(config.telemetry, "connection")
        self.metrics = telemetry.Metrics()
        self.render_handle = render
        self.engine_handle = engine.options(stream=True)
        self.safety_handle = safety
        self.auth = Authenticator(config.auth)
        self.store = await open_store(config.store)
        self.usage = UsageMeter()
        self.safety_ledger = SafetyLedger()
        self.post_work = PostWorkQueue(
            {"usage": self.usage, "safety": self.safety_ledger},
            retries=config.post_work.retries,
            backoff_s=config.post_work.backoff_s,
        )
        eng = config.engine
        default_max = eng.vllm.default_max_tokens if eng.backend == "vllm" else eng.scripted.max_output_tokens
        self.driver = TurnDriver(
            model_name=config.model.name,
            render=self._render,
            engine=self._engine,
            default_max_tokens=default_max,
            max_model_len=config.model.max_model_len,
            verify_renders=config.verify_renders,
            safety=self._classify if safety is not None else None,
            output_chunk_chars=config.safety.output_chunk_chars,
            classify_tool_outputs=config.safety.classify_tool_outputs,
            post_work=self.post_work,
            metrics=self.metrics,
            max_input_items=config.limits.max_input_items,
            max_context_tokens=config.limits.max_context_tokens,
        )
        self.registry = SessionCache(config.cache.replica_max_entries, config.cache.replica_max_bytes)
        self.responses = ResponsesService(self.driver, self.registry, self.store)
        self.post_work.add("persist", self.responses.persist, retry_for_s=config.store.write_retry_s)
        if safety is not None:
            self.post_work.add("output_safety", OutputTailCheck(self._classify, self.safety_ledger))
        for spec in config.post_work.hooks:
            self.post_work.add(spec, load_hook(spec, config))
        self.open_sockets = 0
        self.local_renderer = None
        if config.inline_delta_render:
            tokenizer = await asyncio.to_thread(load_tokenizer, config)
            self.local_renderer = renderer_for(tokenizer)
        self.local_render_mismatches = 0
        self.ws_sessions: set[WebSocketSession] = set()
        self.drain_watch = DrainWatch(self._drain)
        self.drain_watch.start()
        self.metrics.observe("loopserve.session_cache.bytes", self._cache_bytes, "bytes held by session caches", "By")
        self.metrics.observe("loopserve.session_cache.entries", self._cache_entries, "responses held by session caches")

    def _cache_bytes(self):
        return [(self.registry.nbytes, {"cache": "replica"}),
                (self._ws_cache_bytes(), {"cache": "connections"})]

    def _cache_entries(self):
        return [(len(self.registry), {"cache": "replica"}),
                (sum(len(s.cache) for s in list(self.ws_sessions)), {"cache": "connections"})]

    def _ws_cache_bytes(self) -> int:
        return sum(s.cache.nbytes for s in list(self.ws_sessions))

    async def _drain(self) -> None:
        # Scale-down: live sockets finish their turn, then get a clean close to
        # reconnect on (another replica; `store: true` chains continue there).
        await asyncio.gather(*[s.drain() for s in list(self.ws_sessions)], return_exceptions=True)

    # -- ports for the turn driver ----------------------------------------------
    async def _render(self, job: dict[str, Any]):
        if self.local_renderer is not None and job["mode"] == "delta" and "verify_items" not in job:
            result, mismatch = render_job(self.local_renderer, job)
            self.local_render_mismatches += mismatch
            return result
        return await self._retrying("render", lambda: self.render_handle.render.remote(job))

    async def _classify(self, texts: list[str]) -> list[dict[str, Any]]:
        # The caller's span is current (TurnSafety, post-work): it rides along.
        carrier = telemetry.inject(otel_context.get_current())
        return await self._retrying("safety", lambda: self.safety_handle.classify.remote(texts, carrier))

    async def _retrying(self, what: str, call):
        """A unary call to a stateless deployment: a replica that died is retried on
        another (or on its replacement, which Serve starts within seconds)."""
        retries = self.config.routing.engine_retries
        for attempt in range(retries + 1):
            try:
                return await call()
            except (RayActorError, ActorUnavailableError):
                if attempt == retries:
                    raise
                log.warning("%s replica unavailable; retrying (attempt %d)", what, attempt + 1)
                await asyncio.sleep(0.5 * (attempt + 1))

    async def _engine(self, req: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        # The session key rides on every engine call: the consistent-hash router
        # sends all turns of a session to the replica holding its prefix KV.
        handle = self.engine_handle.options(session_id=req["session_key"])
        retries = self.config.routing.engine_retries
        for attempt in range(retries + 1):
            gen = handle.generate.remote(req)
            started = finished = False
            try:
                async for chunk in gen:
                    started = True
                    yield chunk
                finished = True
                return
            except (RayActorError, ActorUnavailableError):
                # The replica died before answering: the router moves the session
                # to a live replica (a full prefill there). Mid-stream: give up.
                if started or attempt == retries:
                    raise
                log.warning("engine replica unavailable; retrying turn %s (attempt %d)", req["request_id"], attempt + 1)
                await asyncio.sleep(0.5 * (attempt + 1))
            finally:
                if not finished:
                    gen.cancel()  # abandoned or failed: cancel (and abort) on the engine

    def _principal(self, request: Request) -> Principal:
        return self.auth.authenticate(request.headers.get("authorization"))

    # -- HTTP --------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        """Ready only when every deployment a turn needs answers (not just this ingress)."""
        checks = [self.render_handle.stats.remote(), self.engine_handle.options(stream=False).stats.remote()]
        if self.safety_handle is not None:
            checks.append(self.safety_handle.stats.remote())
        try:
            await asyncio.wait_for(asyncio.gather(*checks), timeout=5)
        except Exception:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._principal(request)
        return {
            "object": "list",
            "data": [{"id": self.config.model.name, "object": "model", "created": 0, "owned_by": "loopserve"}],
        }

    @app.get("/loopserve/stats")
    async def stats(self, last: int = 200) -> dict[str, Any]:
        render = await self.render_handle.stats.remote()
        engine = await self.engine_handle.options(stream=False).stats.remote()
        safety = await self.safety_handle.stats.remote() if self.safety_handle is not None else None
        writes = self.responses.write_latencies
        return {
            "safety": safety,
            "safety_ledger": self.safety_ledger.snapshot(),
            "blocked_turns": self.driver.blocked_turns,
            "usage": self.usage.snapshot(),
            "post_work": self.post_work.stats(),
            "store_writes": {"count": len(writes), "p50_ms": statistics.median(writes) * 1000 if writes else None,
                             "retried": self.post_work.retried_by["persist"],
                             "failed": self.post_work.failed_by["persist"]},
            "render": render,
            "render_inline": None if self.local_renderer is None else {
                "full_renders": self.local_renderer.full_renders,
                "delta_renders": self.local_renderer.delta_renders,
                "mismatches": self.local_render_mismatches,
            },
            "engine": engine,  # one engine replica's counters
            "open_sockets": self.open_sockets,
            "tasks": len(asyncio.all_tasks()),
            "rss_bytes": rss_bytes(),
            "ws_cache_bytes": self._ws_cache_bytes(),
            "registry_entries": len(self.registry),
            "session_moves": self.driver.session_moves,
            "turns": [t.as_dict() for t in self.driver.timings[-max(1, min(last, 1024)):]],
        }

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(self, request: Request) -> dict[str, Any]:
        p = self._principal(request)
        return await self.responses.input_tokens(await json_body(request, self.config.limits.max_request_bytes), p.tenant)

    @app.post("/v1/responses/compact")
    async def compact(self, request: Request) -> dict[str, Any]:
        p = self._principal(request)
        return await self.responses.compact(await json_body(request, self.config.limits.max_request_bytes), p.tenant)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(self, request: Request, response_id: str, after: Optional[str] = None, limit: int = 20,
                          order: str = "desc") -> dict[str, Any]:
        p = self._principal(request)
        return await self.responses.input_items(response_id, p.tenant, after=after, limit=limit, order=order)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(self, request: Request, response_id: str) -> dict[str, Any]:
        return await self.responses.cancel(response_id, self._principal(request).tenant)

    @app.delete("/v1/responses/{response_id}")
    async def delete(self, request: Request, response_id: str) -> dict[str, Any]:
        return await self.responses.delete(response_id, self._principal(request).tenant)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(self, request: Request, response_id: str, stream: bool = False,
                       starting_after: Optional[int] = None):
        p = self._principal(request)
        if stream:
            events = await self.responses.replay(response_id, p.tenant, starting_after)

            async def replay():
                for ev in events:
                    yield sse(ev)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(replay(), media_type="text/event-stream")
        return JSONResponse(await self.responses.retrieve(response_id, p.tenant))

    @app.post("/v1/responses")
    async def create(self, request: Request):
        received_at = time.perf_counter()
        try:
            p = self._principal(request)
            self.auth.admit_request(p)
            req = parse_request(await json_body(request, self.config.limits.max_request_bytes),
                                max_input_items=self.config.limits.max_input_items)
            parsed_at = time.perf_counter()
            session_key = (request.headers.get("x-session-id") or req.prompt_cache_key or req.previous_response_id
                           or uuid.uuid4().hex)
            if req.background:
                if req.stream:
                    raise ApiError(400, "background responses cannot be streamed here; poll GET /v1/responses/{id}.",
                                   param="stream", code="unsupported_value")
                return JSONResponse(self.responses.start_background(req, p.tenant, session_key))
        except ApiError as err:
            return error_response(err)
        events = self.driver.run(
            req,
            SessionCache(1),  # HTTP has no connection: state goes to the registry
            session_key=session_key,
            lookup=self.responses.lookup_for(p.tenant),
            on_state=self.responses.remember,
            owner=p.tenant,
            received_at=received_at,
            parsed_at=parsed_at,
            trace_parent=telemetry.extract_headers(request.headers),
            transport="http",
        )
        try:
            first = await events.__anext__()
        except ApiError as err:
            return error_response(err)
        if req.stream:
            return StreamingResponse(
                self._sse_stream(first, events),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        final: Optional[dict[str, Any]] = None
        error: Optional[dict[str, Any]] = None
        async for ev in events:
            if ev["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = ev["response"]
            elif ev["type"] == "error":
                error = ev
        if final is None:
            return error_response(server_error())
        if final["status"] == "failed" and error is not None:
            e = error["error"]
            return error_response(ApiError(error.get("status", 500), e["message"], code=e.get("code"), param=e.get("param")))
        return JSONResponse(final)

    async def _sse_stream(self, first: dict[str, Any], events: AsyncIterator[dict[str, Any]]):
        try:
            yield sse(first)
            async for ev in events:
                yield sse(ev)
            yield b"data: [DONE]\n\n"
        finally:
            await events.aclose()  # client gone mid-stream: cancels the engine call

    # -- WebSocket ---------------------------------------------------------------
    @app.websocket("/v1/responses")
    async def websocket(self, ws: WebSocket) -> None:
        if self.drain_watch.draining:
            await self._deny(ws, ApiError(503, "This server is shutting down; connect again.", code="server_draining",
                                          type="server_error"))
            return
        try:
            origin = ws.headers.get("origin")
            allowed = self.config.websocket.allowed_origins
            if allowed and origin is not None and origin not in allowed:
                raise ApiError(403, f"Origin '{origin[:200]}' is not allowed.", code="origin_not_allowed",
                               type="invalid_request_error")
            p = self.auth.authenticate(ws.headers.get("authorization"))
            self.auth.open_connection(p)
        except ApiError as err:
            await self._deny(ws, err)  # before the upgrade: a plain HTTP error
            return
        await ws.accept()
        self.open_sockets += 1
        self.metrics.connections.add(1)
        lock = asyncio.Lock()

        async def send(event: dict[str, Any]) -> None:
            async with lock:
                await ws.send_text(json.dumps(event, separators=(",", ":")))

        async def close(code: int, reason: str) -> None:
            async with lock:
                await ws.close(code=code, reason=reason)

        session = WebSocketSession(
            self.driver,
            SessionCache(self.config.cache.max_entries, self.config.cache.max_bytes),
            session_key=ws.headers.get("x-session-id") or uuid.uuid4().hex,
            config=self.config.websocket,
            send=send,
            close=close,
            lookup=self.responses.lookup_for(p.tenant),
            on_state=self.responses.remember,
            owner=p.tenant,
            admit=lambda: self.auth.admit_request(p),
            trace_parent=telemetry.extract_headers(ws.headers),
        )
        session.start()
        self.ws_sessions.add(session)
        if self.drain_watch.draining:
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
            self.open_sockets -= 1
            self.metrics.connections.add(-1)
            self.ws_sessions.discard(session)
            self.auth.close_connection(p)
            await session.shutdown()

    @app.websocket("/loopserve/echo")
    async def echo(self, ws: WebSocket) -> None:
        """Echoes frames: the latency floor of a WebSocket through the Serve proxy."""
        await ws.accept()
        try:
            while True:
                await ws.send_text(await ws.receive_text())
        except (WebSocketDisconnect, RuntimeError):
            pass

    async def _deny(self, ws: WebSocket, err: ApiError) -> None:
        try:
            await ws.send_denial_response(JSONResponse(err.http_body(), status_code=err.status))
        except Exception:  # the server does not support denial responses: refuse the upgrade
            await ws.close(code=1008, reason=err.message[:120])

    async def __del__(self) -> None:
        self.drain_watch.stop()
        await self.post_work.drain(timeout=10)
        if self.store is not None:
            await self.store.close()
