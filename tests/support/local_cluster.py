"""The tests' local Ray cluster with Serve: the benchmarks' own (`cluster/bench/local.py`: start
and stop it, deploy an app, its admin key, its stats), reached by tests through this one module
as they reach the benchmarks' WebSocket client through `ws.py`."""

from __future__ import annotations

from cluster.bench.local import (
    LOCAL_ADMIN_KEY,
    admin_headers,
    deploy,
    free_port,
    start_local_serve,
    stats,
    stop_local_serve,
)

__all__ = ["LOCAL_ADMIN_KEY", "admin_headers", "deploy", "free_port", "start_local_serve", "stats",
           "stop_local_serve"]
