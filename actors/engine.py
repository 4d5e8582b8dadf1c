"""EngineReplica: Serve's deployment of one engine (vLLM or scripted), a thin shim around
`EngineService` (cluster/engines/service.py: the engine, its output parser, the KV admission), plus
the direct channel the sessions' later turns stream from."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from ray import serve

from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.core.messages import EngineChunk, EngineRequest, done_of
from cluster.engines.channel import ChannelServer, tls_contexts
from cluster.engines.kv.budget import KV_METRICS
from cluster.engines.service import EngineService


@serve.deployment(name="EngineReplica")
class EngineReplica:
    async def __init__(self, config: LoopserveConfig, engine_cls: Optional[type] = None) -> None:
        self.config = config
        telemetry.setup(config.telemetry, "engine")
        try:
            replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests)
            replica_id = "local"
        self.replica_id = replica_id
        self.service = await EngineService.build(config, engine_cls, replica_id)
        service = self.service
        metrics = telemetry.Metrics()
        metrics.observe("loopserve.engine.queue_depth", lambda: [(service.in_flight, {})],
                        "requests in this engine replica (queued or running)")
        for name, (key, description) in KV_METRICS.items():
            metrics.observe(name, lambda key=key: [(service.exported_kv().get(key, 0), {"replica": replica_id})],
                            description)
        self.channel: Optional[ChannelServer] = None
        if config.engine.direct_stream:
            import ray

            self.channel = ChannelServer(service.generate, tls=tls_contexts(config.engine.channel_tls)[0])
            await self.channel.start(config.engine.channel_host or ray.util.get_node_ip_address())

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """The Serve handle's path (a session's first turn, or a fallback): the answer
        names this replica's direct channel for the session's next turns."""
        async with aclosing(self.service.generate(req, batch=True)) as chunks:
            async for chunk in chunks:
                done = done_of(chunk)
                if self.channel is not None and done is not None:
                    done.channel = self.channel.endpoint
                yield chunk

    async def release_session(self, session_key: str, cache_salt: Optional[str] = None) -> None:
        """The session will not be back (its socket closed, nothing stored): its KV goes now."""
        self.service.release(session_key, cache_salt)

    def kv_figures(self) -> dict[str, Any]:
        return self.service.kv_figures()

    async def stats(self) -> dict[str, Any]:
        import ray

        return {**self.service.stats(), "node": ray.get_runtime_context().get_node_id()}

    async def channel_endpoint(self) -> tuple[str, str]:
        """This replica's direct channel ("" when off or draining) and its id: a session placed here
        streams its turns from it (cluster/serving/clients.py)."""
        draining = self.channel is None or self.channel.closing or self.channel.keeps is not None
        return (self.channel.endpoint if not draining else "",
                self.replica_id)

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the KV placement router (cluster/serve_plugins/kv_router.py) places new sessions by."""
        admission = self.service.admission
        return admission.routing_stats() if admission is not None else {}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What this replica runs, handle and direct-channel requests alike, and its KV demand
        (running + retained + queued tokens over capacity) and queue wait (cluster/serve_plugins/autoscaling.py)."""
        admission = self.service.admission
        kv = admission.autoscaling_stats() if admission is not None else {}
        return {"in_flight": float(self.service.in_flight), **kv}

    async def check_health(self) -> None:
        await self.service.engine.check_health()

    async def _drain_retention(self, channel: ChannelServer) -> None:
        """Leaving (scale-down, redeploy): Serve routes no new session here any more, and sessions
        retained here keep their turns on this replica over the direct channel until their retention
        runs out, within half the graceful shutdown window (Serve counts it from the stop: handle
        requests drained first, turns in flight finished after).
        Then the channel closes and they are placed again (counted as moved sessions)."""
        service = getattr(self, "service", None)  # a constructor that failed part-way made none
        admission = service.admission if service is not None else None
        if admission is not None:
            await admission.drain(channel.drain, lambda: channel.in_flight,
                                  0.5 * self.config.engine_deployment.graceful_shutdown_timeout_s)

    async def __del__(self) -> None:
        # Serve runs this after a constructor that failed part-way too: what was not made is
        # skipped, and an engine that started is still shut down (its processes would outlive us).
        channel, service = getattr(self, "channel", None), getattr(self, "service", None)
        if channel is not None:
            await self._drain_retention(channel)
            # Draining: new turns go back through the handle (to live replicas); the
            # ones streaming here finish first.
            await channel.close()
            for _ in range(600):
                if not channel.in_flight:
                    break
                await asyncio.sleep(0.1)
        if service is not None:
            try:
                await service.engine.shutdown()
            except Exception:
                pass
