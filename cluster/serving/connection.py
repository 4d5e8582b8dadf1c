"""The composition root of a connection replica: everything its routes use, built from
the config and the other deployments' handles.

`ConnectionActor` (actors/connection.py) builds one `ConnectionServices` and hands it
to the routes; it owns nothing else. Session caches (one per WebSocket, all under one
replica-wide memory bound), the replica-wide cache of `store: true` responses, the
durable store, auth and per-key limits, post-inference work and the turn driver live
here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from typing import Any, Awaitable, Callable, Mapping, Optional, Protocol, TypeVar

from ray.serve.handle import DeploymentHandle

from cluster import telemetry
from cluster.config.backends import backend_of
from cluster.auth import Authenticator, Principal
from cluster.config import LoopserveConfig
from cluster.core.render.audit import RenderAudit, ReplicaVerdict
from cluster.core.render.images import ImageLimits
from cluster.core.render.tokenizer import (
    attach_images,
    load_tokenizer,
    renderer_for,
    watch_fallbacks,
)
from cluster.core.safety.classifiers import SafetyService, local_classifier
from cluster.core.turn.cache import CacheMemory, SessionCache
from cluster.core.turn.driver import TurnDriver
from cluster.core.turn.post_work import (
    OutputTailCheck,
    PostWorkQueue,
    SafetyLedger,
    UsageMeter,
    load_hook,
)
from cluster.core.turn.prepare import TurnSettings
from cluster.protocol.request_bounds import frame_too_large
from cluster.engines.channel import tls_contexts
from cluster.engines.output_parser import tool_format
from cluster.protocol.errors import ApiError
from cluster.protocol.sealing import Sealer, new_key
from cluster.serving.clients import (
    EngineClient,
    RenderClient,
    SafetyClient,
    deployment_retry,
)
from cluster.serving.conversations import ConversationsService
from cluster.serving.mcp_client import McpClient
from cluster.serving.responses import ResponsesService
from cluster.serving.turns import TurnsService
from cluster.store import ResponseStore, open_store

HEALTH_TTL_S = 1.0
READY_RETRY_S = 5.0  # what a 503 of a starting server tells clients and probes to wait


class SharedCheck:
    """An async check run at most once per `ttl_s`: callers meanwhile share its outcome."""

    def __init__(self, check: Callable[[], Awaitable[None]], ttl_s: float) -> None:
        self.check, self.ttl_s = check, ttl_s
        self._last: Optional[asyncio.Future] = None
        self._at = 0.0

    async def __call__(self) -> None:
        now = time.monotonic()
        if self._last is None or (self._last.done() and now - self._at > self.ttl_s):
            self._at = now
            self._last = asyncio.ensure_future(self.check())
        await asyncio.shield(self._last)


class _Answer(Protocol):
    body: bytes


R = TypeVar("R", bound=_Answer)  # a response with its body rendered (JSONResponse)
log = logging.getLogger("loopserve.connection")
DRAIN_SETTLE_S = 2.0  # how long a draining socket waits for its responses' store writes


class ConnectionServices:
    def __init__(self, config: LoopserveConfig, *, render: RenderClient, engine: EngineClient,
                 safety: Optional[SafetyClient], store: Optional[ResponseStore]) -> None:
        self.config = config
        self.metrics = telemetry.Metrics()
        self.loop_health = telemetry.LoopHealth()
        if render.local is not None:
            watch_fallbacks(render.local, self.metrics)
        self.auth = Authenticator(config.auth)  # refuses to start without keys it requires; rereads keys_file
        self.render, self.engine, self.safety, self.store = render, engine, safety, store
        self.usage = UsageMeter()
        self.safety_ledger = SafetyLedger()
        # /health is open to anyone and a check asks every deployment for its stats: one check
        # serves every caller for HEALTH_TTL_S (its failure too).
        self.health = SharedCheck(self._check_health, HEALTH_TTL_S)
        self.post_work = PostWorkQueue({"usage": self.usage, "safety": self.safety_ledger},
                                       retries=config.post_work.retries, backoff_s=config.post_work.backoff_s)
        settings = turn_settings(config)
        if render.local is not None:
            settings.max_token_chars = render.local.max_token_chars
            settings.min_user_message_tokens = render.local.min_user_message_tokens
        self.mcp = McpClient(config.mcp) if config.mcp.enabled else None  # `mcp` tools, run by this replica
        self.driver = TurnDriver(settings, render=render, engine=engine, safety=safety,
                                 post_work=self.post_work, metrics=self.metrics,
                                 items=store.get_item if store is not None else None, sealer=cluster_sealer(config),
                                 mcp=self.mcp)
        self.registry = SessionCache(config.cache.replica_max_entries, config.cache.replica_max_bytes)
        self.memory = CacheMemory(config.cache.max_entries, config.cache.max_bytes, config.cache.connections_max_bytes)
        self.responses = ResponsesService(self.driver, self.registry, store, max_background=config.limits.max_background,
                                          max_background_per_tenant=config.limits.max_background_per_tenant)
        self.conversations = ConversationsService(store, model=config.model.name, max_items=config.limits.max_input_items)
        self.responses.conversations = self.conversations
        self.post_work.add("persist", self.responses.persist, retry_for_s=config.store.write_retry_s)
        if safety is not None:
            self.post_work.add("output_safety", OutputTailCheck(safety, self.safety_ledger,
                                                                on_flagged=self.responses.mark_blocked))
        self.render_audit: Optional[RenderAudit] = None
        self.verdict: Optional[ReplicaVerdict] = None
        if config.render_audit_every and render.local is not None:
            self.render_audit = RenderAudit(render, config.render_audit_every, decode=render.local.decode,
                                            on_mismatch=self.driver.preparer.render_fully,
                                            on_checked=self.metrics.render_audited, first=config.render_audit_first)
            self.post_work.add("render_audit", self.render_audit)
            preparer = self.driver.preparer
            # Shared with the other connection replicas through the ledger (actors/limits.py).
            self.verdict = ReplicaVerdict(render.local.template_source, lambda: preparer.deltas_off,
                                          preparer.render_fully)
        for spec in config.post_work.hooks:
            self.post_work.add(spec, load_hook(spec, config))
        self.turns = TurnsService(config, driver=self.driver, responses=self.responses, auth=self.auth,
                                  memory=self.memory, engine=engine, metrics=self.metrics,
                                  settle=self.settle_responses, conversations=self.conversations)
        self.metrics.observe("loopserve.session_cache.bytes", self._cache_bytes, "bytes held by session caches", "By")
        self.metrics.observe("loopserve.session_cache.entries", self._cache_entries, "responses held by session caches")

    @classmethod
    async def build(cls, config: LoopserveConfig, *, render: Optional[DeploymentHandle], engine: DeploymentHandle,
                    safety: Optional[DeploymentHandle] = None) -> "ConnectionServices":
        retry = deployment_retry(config)
        local_renderer = None
        if config.inline_delta_render:
            tokenizer = await asyncio.to_thread(load_tokenizer, config)
            local_renderer = renderer_for(tokenizer, analysis=config.template_analysis, model=config.model)
            await asyncio.to_thread(attach_images, local_renderer, config)
        safety_client = None
        if config.safety.runs_inline:  # no hop before the first token
            s = config.safety
            classifier = await asyncio.to_thread(local_classifier, s.policy, s.classifier, s.profanity_threshold)
            safety_client = SafetyClient(retry, inline=SafetyService(classifier, tracer=telemetry.tracer()))
        elif safety is not None:
            safety_client = SafetyClient(retry, handle=safety)
        return cls(config, render=RenderClient(render, retry, local_renderer), engine=EngineClient(engine, retry, direct=config.engine.direct_stream,
                                                                             tls=tls_contexts(config.engine.channel_tls)[1]),
                   safety=safety_client, store=await open_store(config.store))

    def _cache_bytes(self):
        return [(self.registry.nbytes, {"cache": "replica"}), (self.memory.nbytes, {"cache": "connections"})]

    def _cache_entries(self):
        return [(len(self.registry), {"cache": "replica"}), (self.memory.entries(), {"cache": "connections"})]

    async def drain(self) -> None:
        await self.turns.drain()

    async def settle_responses(self, response_ids: list[str]) -> bool:
        """A draining socket's last responses reach the store before it sends the client elsewhere:
        bounded well inside the ingress's draining window (10 s), which the turn in flight shares."""
        return await self.post_work.settle(response_ids, timeout=DRAIN_SETTLE_S)

    async def close(self) -> None:
        if self.engine.pool is not None:
            await self.engine.pool.close()
        await self.post_work.drain(timeout=10)
        if self.store is not None:
            await self.store.close()

    # -- what the routes (actors/routes.py) ask of every request --------------------
    def principal(self, headers: Mapping[str, str]) -> Principal:
        """Who sent an HTTP request; a browser page from a foreign Origin is refused first (the
        WebSocket's rule: `TurnService.check_origin`)."""
        self.turns.check_origin(headers.get("origin"))
        return self.auth.authenticate(headers.get("authorization"))

    def read_principal(self, headers: Mapping[str, str]) -> Principal:
        """`principal`, admitted against its key's read limit (GET, DELETE, cancel)."""
        p = self.principal(headers)
        self.auth.admit_read(p)
        return p

    def read(self, p: Principal, response: R) -> R:
        """An answered read, its body charged to the key's `read_bytes_per_minute`."""
        self.auth.charge_read(p, len(response.body))
        return response

    def frame_too_large(self, size: int) -> ApiError:
        return frame_too_large(size, self.config.websocket.max_frame_bytes)

    async def not_ready(self) -> Optional[ApiError]:
        """None once every deployment a turn needs answers; else the 503 (with Retry-After) that
        `/health` and `/v1/models` answer while the app starts (or an engine replica restarts)."""
        try:
            await self.health()
        except Exception:  # noqa: BLE001 - a deployment not answering, whatever the cause
            return ApiError(503, "The server is starting: its engine is not ready to run a turn yet. Retry shortly.",
                            code="server_starting", type="server_error", retry_after_s=READY_RETRY_S)
        return None

    async def _check_health(self) -> None:
        """Raises unless every deployment a turn needs answers."""
        checks = [self.render.stats(), self.engine.stats()]
        if self.safety is not None and self.safety.handle is not None:
            checks.append(self.safety.stats())
        await asyncio.wait_for(asyncio.gather(*checks), timeout=5)

    async def stats(self, last: int, engine_session: Optional[str], rss_bytes: Optional[int]) -> dict[str, Any]:
        """Counters and recent turn timings (the admin-only stats route)."""
        m = self.metrics
        writes = list(m.store_write_seconds)
        return {
            "safety": await self.safety.stats() if self.safety is not None else None,
            "safety_ledger": self.safety_ledger.snapshot(),
            "blocked_turns": m.blocked_turns,
            "usage": self.usage.snapshot(),
            "post_work": self.post_work.stats(),
            "store_writes": {"count": len(writes), "p50_ms": statistics.median(writes) * 1000 if writes else None,
                             "retried": self.post_work.retried_by["persist"],
                             "failed": self.post_work.failed_by["persist"]},
            "render": await self.render.stats(),
            "render_inline": self.render.local_stats(),
            "pid": os.getpid(),  # which connection replica answered
            "render_audit": {**(self.render_audit.stats() if self.render_audit else {}),
                             "deltas_off": self.driver.preparer.deltas_off},
            "engine": await self.engine.stats(engine_session),  # one engine replica's counters
            "engine_calls": self.engine.counters(),  # this replica's: direct channel vs Serve handle
            "open_sockets": m.open_sockets,
            "tasks": len(asyncio.all_tasks()),
            "loop": self.loop_health.snapshot(),
            "background": len(self.responses.background),
            "rss_bytes": rss_bytes,
            "ws_cache_bytes": self.memory.nbytes,
            "ws_cache_reclaimed": self.memory.reclaimed,
            "registry_entries": len(self.registry),
            "registry_bytes": self.registry.nbytes,
            "session_moves": m.session_moves,
            "prompt_resends": m.prompt_resends,
            "compactions": m.compactions,
            "turn_status": dict(m.turn_status),
            "turn_transport": dict(m.turn_transport),
            "turns": m.recent_turns(last),
        }


def cluster_sealer(config: LoopserveConfig) -> Sealer:
    """The sealer of `encrypted_content` from the config's keys (`build_app` puts a deployment-wide
    key there when none is configured). Built without one (a replica made outside `build_app`), this
    replica makes its own key: its blobs open on it alone."""
    keys, active = config.sealing.resolved()
    if not keys:
        log.warning("no sealing key configured: compaction and reasoning blobs open on this replica only")
        keys, active = {"replica": new_key()}, "replica"
    return Sealer.from_text(keys, active)


def turn_settings(config: LoopserveConfig) -> TurnSettings:
    """The turn core's slice of the config."""
    eng, backend = config.engine, backend_of(config.engine)
    forcible = backend.forces_tool_calls
    return TurnSettings(
        model_name=config.model.name,
        default_max_tokens=backend.default_max_tokens(backend.settings(eng)),
        max_model_len=config.model.max_model_len,
        verify_renders=config.verify_renders,
        output_chunk_chars=config.safety.output_chunk_chars,
        classify_tool_outputs=config.safety.classify_tool_outputs,
        max_input_items=config.limits.max_input_items,
        max_context_tokens=config.limits.max_context_tokens,
        max_context_bytes=config.limits.max_context_bytes,
        can_force_tool_calls=tool_format(config.model.tool_parser).forcible if forcible is None else forcible,
        sampling_defaults=model_sampling_defaults(config) if backend.model_sampling else {},
        images=ImageLimits(config.model.images.max_per_context, config.model.images.max_image_bytes,
                           config.model.images.max_image_pixels)
        if config.model.images is not None else None,
    )


def model_sampling_defaults(config: LoopserveConfig) -> dict[str, float]:
    """The temperature and top_p vLLM applies to a request that sets none: the model's
    generation_config.json (vLLM's `generation_config: auto`), else 1.0 each."""
    import json
    from pathlib import Path

    path = Path(config.model.resolved_path()) / "generation_config.json"
    if not path.is_file():  # a hub id: the file from the Hugging Face cache, if the model has one
        try:
            from transformers.utils import cached_file

            found = cached_file(config.model.resolved_path(), "generation_config.json",
                                _raise_exceptions_for_missing_entries=False)
        except Exception:  # noqa: BLE001 - no generation config: vLLM's own defaults
            return {}
        if not found:
            return {}
        path = Path(found)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(data[k]) for k in ("temperature", "top_p") if isinstance(data.get(k), (int, float))}
