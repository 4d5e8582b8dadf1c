"""ConnectionActor: the Serve ingress (FastAPI), HTTP + SSE and WebSocket routes.

Owns one `SessionCache` per WebSocket connection and a replica-wide cache of
`store: true` responses (HTTP continuations, reconnects). Turns are driven by
the shared `TurnDriver`; render and engine are reached through handles.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.websockets import WebSocketDisconnect

from cluster.config import LoopserveConfig
from cluster.core.post_work import OutputTailCheck, PostWorkQueue, SafetyLedger, UsageMeter, load_hook
from cluster.core.session_cache import SessionCache
from cluster.core.state import ResponseState
from cluster.core.turn import TurnDriver
from cluster.core.ws_session import WebSocketSession
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.requests import parse_request

log = logging.getLogger("loopserve.connection")

app = FastAPI(title="loopserve", docs_url=None, redoc_url=None)


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.http_body(), status_code=err.status)


@app.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return _error_response(exc)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(ApiError(exc.status_code, str(exc.detail), code=code))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _error_response(ApiError(400, "Invalid request.", code="invalid_value"))


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


@serve.deployment(name="ConnectionActor")
@serve.ingress(app)
class ConnectionActor:
    def __init__(
        self,
        render: DeploymentHandle,
        engine: DeploymentHandle,
        config: LoopserveConfig,
        safety: Optional[DeploymentHandle] = None,
    ) -> None:
        self.config = config
        self.render_handle = render
        self.engine_handle = engine.options(stream=True)
        self.safety_handle = safety
        self.usage = UsageMeter()
        self.safety_ledger = SafetyLedger()
        self.post_work = PostWorkQueue(
            {"usage": self.usage, "safety": self.safety_ledger},
            retries=config.post_work.retries,
            backoff_s=config.post_work.backoff_s,
        )
        if safety is not None:
            self.post_work.add("output_safety", OutputTailCheck(self._classify, self.safety_ledger))
        for spec in config.post_work.hooks:
            self.post_work.add(spec, load_hook(spec, config))
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
        )
        # Replica-wide: `store: true` responses, for HTTP continuations and reconnects.
        self.registry = SessionCache(config.cache.replica_max_entries, config.cache.replica_max_bytes)
        self.open_sockets = 0

    # -- ports for the turn driver ----------------------------------------------
    async def _render(self, job: dict[str, Any]):
        return await self.render_handle.render.remote(job)

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

    async def _classify(self, texts: list[str]) -> list[dict[str, Any]]:
        return await self.safety_handle.classify.remote(texts)

    async def _lookup(self, response_id: str) -> Optional[ResponseState]:
        return self.registry.get(response_id)

    def _remember(self, state: ResponseState) -> None:
        if state.store:
            self.registry.put(state)

    # -- HTTP --------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.config.model.name, "object": "model", "created": 0, "owned_by": "loopserve"}],
        }

    @app.get("/loopserve/stats")
    async def stats(self, last: int = 200) -> dict[str, Any]:
        render = await self.render_handle.stats.remote()
        engine = await self.engine_handle.options(stream=False).stats.remote()
        safety = await self.safety_handle.stats.remote() if self.safety_handle is not None else None
        return {
            "safety": safety,
            "safety_ledger": self.safety_ledger.snapshot(),
            "blocked_turns": self.driver.blocked_turns,
            "usage": self.usage.snapshot(),
            "post_work": self.post_work.stats(),
            "render": render,
            "engine": engine,  # one engine replica's counters
            "open_sockets": self.open_sockets,
            "registry_entries": len(self.registry),
            "session_moves": self.driver.session_moves,
            "turns": [t.as_dict() for t in self.driver.timings[-max(1, min(last, 1024)):]],
        }

    @app.get("/v1/responses/{response_id}")
    async def retrieve(self, response_id: str) -> JSONResponse:
        state = self.registry.get(response_id)
        if state is None or state.response is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", code="not_found", param="response_id")
        return JSONResponse(state.response)

    @app.post("/v1/responses")
    async def create(self, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error_response(
                ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json")
            )
        try:
            req = parse_request(body)
            if req.background:
                raise ApiError(400, "background responses are not supported yet.", param="background", code="unsupported_value")
        except ApiError as err:
            return _error_response(err)
        session_key = request.headers.get("x-session-id") or req.prompt_cache_key or req.previous_response_id or uuid.uuid4().hex
        events = self.driver.run(
            req,
            SessionCache(1),  # HTTP has no connection: state goes to the registry
            session_key=session_key,
            lookup=self._lookup,
            on_state=self._remember,
        )
        try:
            first = await events.__anext__()
        except ApiError as err:
            return _error_response(err)
        except StopAsyncIteration:  # pragma: no cover - the driver always yields
            return _error_response(server_error())
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
            return _error_response(server_error())
        if final["status"] == "failed" and error is not None:
            e = error["error"]
            return _error_response(ApiError(error.get("status", 500), e["message"], code=e.get("code"), param=e.get("param")))
        return JSONResponse(final)

    async def _sse_stream(self, first: dict[str, Any], events: AsyncIterator[dict[str, Any]]):
        try:
            yield _sse(first)
            async for ev in events:
                yield _sse(ev)
            yield b"data: [DONE]\n\n"
        finally:
            await events.aclose()  # client gone mid-stream: cancels the engine call

    # -- WebSocket ---------------------------------------------------------------
    @app.websocket("/v1/responses")
    async def websocket(self, ws: WebSocket) -> None:
        await ws.accept()
        self.open_sockets += 1
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
            lookup=self._lookup,
            on_state=self._remember,
        )
        session.start()
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
            await session.shutdown()
