"""ConnectionActor: the Serve ingress (FastAPI), HTTP + SSE and WebSocket.

A thin shell: it builds the replica's `ConnectionServices` (the composition root,
`cluster/serving/connection.py`) from the config and the other deployments'
handles, hands them to the routes (`actors/routes.py`), and owns the one timer
Serve needs from it: watching for the replica being drained.
"""

from __future__ import annotations

from typing import Optional

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.drain import DrainWatch
from actors.routes import app, bind
from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.serving.connection import ConnectionServices


@serve.deployment(name="ConnectionActor")
@serve.ingress(app)
class ConnectionActor:
    async def __init__(
        self,
        render: Optional[DeploymentHandle],  # None: full renders run here (`render_in_connection`)
        engine: DeploymentHandle,
        config: LoopserveConfig,
        safety: Optional[DeploymentHandle] = None,
    ) -> None:
        telemetry.setup(config.telemetry, "connection")
        self.services = await ConnectionServices.build(config, render=render, engine=engine, safety=safety)
        self.drain_watch = DrainWatch(self.services.drain)
        self.drain_watch.start()
        bind(self.services)  # the routes reach this replica through a dependency

    async def __del__(self) -> None:
        self.drain_watch.stop()
        await self.services.close()
