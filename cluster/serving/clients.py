"""Clients of the other deployments over Ray Serve handles, behind the turn core's ports.

Every call goes through one `RetryPolicy`: a replica that died (before answering,
or before an engine stream's first chunk) is retried on another one or on its
replacement; anything else is the caller's to handle.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

from opentelemetry import context as otel_context
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from .. import telemetry
from ..config import LoopserveConfig
from ..core.messages import EngineChunk, EngineRequest, RenderJob
from ..core.render import IncrementalRenderer, RenderResult, render_job
from ..core.retry import RetryPolicy
from ..core.safety import SafetyService

log = logging.getLogger("loopserve.connection")


def replica_gone(exc: BaseException) -> bool:
    return isinstance(exc, (RayActorError, ActorUnavailableError))


def deployment_retry(config: LoopserveConfig) -> RetryPolicy:
    # 0.6 s, 0.9 s, 1.35 s, ...: the default 5 retries (~8 s) cover a replica restart.
    return RetryPolicy(retries=config.routing.engine_retries, backoff_s=0.6, multiplier=1.5, max_delay_s=3.0)


class RenderClient:
    """The render port: a delta inline when this replica has the tokenizer, else the RenderActor."""

    def __init__(self, handle: DeploymentHandle, retry: RetryPolicy,
                 local: Optional[IncrementalRenderer] = None) -> None:
        self.handle, self.retry, self.local = handle, retry, local
        self.local_mismatches = 0

    async def __call__(self, job: RenderJob) -> Optional[RenderResult]:
        if self.local is not None and job.inline_ok:
            result, mismatch = render_job(self.local, job)
            self.local_mismatches += mismatch
            return result
        return await self.retry.call("render", lambda: self.handle.render.remote(job), replica_gone)

    async def stats(self) -> dict[str, Any]:
        return await self.handle.stats.remote()

    def local_stats(self) -> Optional[dict[str, int]]:
        if self.local is None:
            return None
        return {"full_renders": self.local.full_renders, "delta_renders": self.local.delta_renders,
                "mismatches": self.local_mismatches}


class SafetyClient:
    """The safety port: the local classifiers in this replica (no hop before the first
    token), or the SafetyActor (model-based guards)."""

    def __init__(self, retry: RetryPolicy, *, inline: Optional[SafetyService] = None,
                 handle: Optional[DeploymentHandle] = None) -> None:
        self.retry, self.inline, self.handle = retry, inline, handle

    async def __call__(self, texts: list[str]) -> list[dict[str, Any]]:
        if self.inline is not None:
            return await self.inline.classify(texts)  # the caller's span is current
        # The caller's span is current (TurnSafety, post-work): it rides along.
        carrier = telemetry.inject(otel_context.get_current())
        return await self.retry.call("safety", lambda: self.handle.classify.remote(texts, carrier), replica_gone)

    async def stats(self) -> dict[str, Any]:
        return self.inline.stats() if self.inline is not None else await self.handle.stats.remote()


class EngineClient:
    """The engine port: a stream of chunks from the replica the session key routes to."""

    def __init__(self, handle: DeploymentHandle, retry: RetryPolicy) -> None:
        self.handle = handle.options(stream=True)
        self.retry = retry

    def __call__(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        # A replica that died before the first chunk: the router moves the session to a
        # live replica (a full prefill there). Mid-stream: the turn fails.
        return self.retry.stream("engine", lambda: self._stream(req), replica_gone)

    async def _stream(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        # The session key rides on every engine call: the consistent-hash router
        # sends all turns of a session to the replica holding its prefix KV.
        gen = self.handle.options(session_id=req.session_key).generate.remote(req)
        finished = False
        try:
            async for chunk in gen:
                yield chunk
            finished = True
        finally:
            if not finished:
                gen.cancel()  # abandoned or failed: cancel (and abort) on the engine

    async def stats(self, session: Optional[str] = None) -> dict[str, Any]:
        handle = self.handle.options(stream=False)
        if session:
            handle = handle.options(session_id=session)
        return await handle.stats.remote()
