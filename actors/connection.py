"""ConnectionActor: the Serve ingress (FastAPI), HTTP + SSE and WebSocket.

A thin shell: it builds the replica's `ConnectionServices` (the composition root,
`cluster/serving/connection.py`) from the config and the other deployments'
handles, builds the replica's app around them (`actors/routes.py`: Serve asks for it once the
constructor is done), and owns the one timer Serve needs from it: watching for the replica being
drained.
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.drain import DrainWatch
from actors.limits import LimitReporter
from actors.gc_policy import CollectorThresholds
from actors.loop_watch import LoopWatch
from actors.routes import build_app
from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.serving.connection import ConnectionServices


@serve.deployment(name="ConnectionActor")
@serve.ingress()  # late-bound: the app is built in the replica, around its services
class ConnectionActor:
    async def __init__(
        self,
        render: Optional[DeploymentHandle],  # None: full renders run here (`render_in_connection`)
        engine: DeploymentHandle,
        config: LoopserveConfig,
        safety: Optional[DeploymentHandle] = None,
        limits: Optional[DeploymentHandle] = None,  # the LimitsAndVerdicts: keys' limits held app-wide
    ) -> None:
        telemetry.setup(config.telemetry, "connection")
        self.services = await ConnectionServices.build(config, render=render, engine=engine, safety=safety)
        self.drain_watch = DrainWatch(self.services.drain)
        self.drain_watch.start()
        self.collector = CollectorThresholds()
        self.collector.apply()
        self.loop_watch = LoopWatch(self.services.loop_health)
        self.loop_watch.start()
        self.limit_reports: Optional[LimitReporter] = None
        if limits is not None:
            self.limit_reports = LimitReporter(self.services.auth, limits, verdicts=self.services.verdict)
            await self.limit_reports.report_once()  # the first request counts what the others hold
            self.limit_reports.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.services)

    async def __del__(self) -> None:
        self.drain_watch.stop()
        self.loop_watch.stop()
        self.collector.restore()
        if self.limit_reports is not None:
            self.limit_reports.stop()
        await self.services.close()
