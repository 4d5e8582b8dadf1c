"""ConnectionActor: the Serve ingress (FastAPI), HTTP + SSE and WebSocket.

Owns one `SessionCache` per WebSocket connection (all of them under one
replica-wide memory bound), a replica-wide cache of `store: true` responses,
the durable store, auth and per-key limits. Turns are driven by the shared
`TurnDriver`; render, engine and safety are reached through handles. Routes
live in `actors/routes.py` and reach this object through a dependency.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

from fastapi import Request, WebSocket
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from opentelemetry import context as otel_context

from actors.drain import DrainWatch
from actors.routes import app, bind
from cluster import telemetry
from cluster.auth import Authenticator, Principal
from cluster.config import LoopserveConfig
from cluster.core.render import render_job
from cluster.core.post_work import OutputTailCheck, PostWorkQueue, SafetyLedger, UsageMeter, load_hook
from cluster.core.safety import SafetyService, local_classifier
from cluster.core.session_cache import CacheMemory, SessionCache
from cluster.core.turn import TurnDriver
from cluster.core.ws_session import WebSocketSession, frame_too_large
from cluster.protocol.errors import ApiError
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
        self.local_safety: Optional[SafetyService] = None
        if config.safety.runs_inline:  # no hop before the first token
            s = config.safety
            classifier = await asyncio.to_thread(local_classifier, s.policy, s.classifier, s.profanity_threshold)
            self.local_safety = SafetyService(classifier, tracer=telemetry.tracer())
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
            safety=self._classify if (safety is not None or config.safety.runs_inline) else None,
            output_chunk_chars=config.safety.output_chunk_chars,
            classify_tool_outputs=config.safety.classify_tool_outputs,
            post_work=self.post_work,
            metrics=self.metrics,
            max_input_items=config.limits.max_input_items,
            max_context_tokens=config.limits.max_context_tokens,
            max_context_bytes=config.limits.max_context_bytes,
        )
        self.registry = SessionCache(config.cache.replica_max_entries, config.cache.replica_max_bytes)
        self.memory = CacheMemory(config.cache.max_entries, config.cache.max_bytes, config.cache.connections_max_bytes)
        self.responses = ResponsesService(self.driver, self.registry, self.store,
                                          max_background=config.limits.max_background)
        self.post_work.add("persist", self.responses.persist, retry_for_s=config.store.write_retry_s)
        if safety is not None or self.local_safety is not None:
            self.post_work.add("output_safety", OutputTailCheck(self._classify, self.safety_ledger,
                                                                on_flagged=self.responses.mark_blocked))
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
        bind(self)  # the routes reach this replica through a dependency

    def _cache_bytes(self):
        return [(self.registry.nbytes, {"cache": "replica"}), (self.memory.nbytes, {"cache": "connections"})]

    def _cache_entries(self):
        return [(len(self.registry), {"cache": "replica"}), (self.memory.entries(), {"cache": "connections"})]

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
        if self.local_safety is not None:
            return await self.local_safety.classify(texts)  # the caller's span is current
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

    # -- helpers for the routes (actors/routes.py) ----------------------------------
    def principal(self, request: Request) -> Principal:
        return self.auth.authenticate(request.headers.get("authorization"))

    def check_origin(self, ws: WebSocket) -> None:
        origin = ws.headers.get("origin")
        allowed = self.config.websocket.allowed_origins
        if allowed and origin is not None and origin not in allowed:
            raise ApiError(403, f"Origin '{origin[:200]}' is not allowed.", code="origin_not_allowed",
                           type="invalid_request_error")

    def frame_too_large(self, size: int) -> ApiError:
        return frame_too_large(size, self.config.websocket.max_frame_bytes)

    async def deny(self, ws: WebSocket, err: ApiError) -> None:
        try:
            await ws.send_denial_response(JSONResponse(err.http_body(), status_code=err.status))
        except Exception:  # the server does not support denial responses: refuse the upgrade
            await ws.close(code=1008, reason=err.message[:120])

    async def __del__(self) -> None:
        self.drain_watch.stop()
        await self.post_work.drain(timeout=10)
        if self.store is not None:
            await self.store.close()
