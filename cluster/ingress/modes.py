"""How clients reach the connection replicas: Ray Serve's HAProxy ingress, or its Python proxy.

`haproxy` (the default of `loopserve serve`, the image and the RayService): Serve runs
HAProxy in front of the connection replicas and each replica takes its traffic on its
own port, so a WebSocket's frames cross no Python actor; calls between replicas use
Serve's throughput-optimized path. HAProxy hashes `x-session-id`, so the HTTP turns
of one session reach the same connection replica (its in-memory chain); requests
without the header are spread round-robin. Measured on a 50-turn WebSocket loop
(README): the client-observed overhead per turn about halves.

`proxy`: Serve's Python proxy actor relays every request and frame (Serve's default,
what a plain `serve run` gives unless the environment below is set).

Both are cluster-wide: Serve's controller and proxies read them when they start, so
they belong in the environment of the process that starts Ray (`loopserve serve`
sets them) or of every Ray container (infra/).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Literal, Optional

log = logging.getLogger(__name__)

IngressMode = Literal["haproxy", "proxy"]

# Ray Serve's request-path settings from its throughput-optimized profile. Measured on the
# agent loop (2 cores, scripted engine): WebSocket turn overhead p50 12.0 -> 9.3 ms, 8
# concurrent loops 23 -> 46 turns/s. User code then shares the replica's event loop, so
# nothing in a deployment may block it for long (full renders and store writes run in
# threads). Read at import in every Serve process: the replicas get them from the app
# (`cluster.app`), the proxy from the cluster's environment.
SERVE_FAST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}

HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # HAProxy's `balance hdr(<name>)`: one session's requests go to one replica.
    "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "hdr(x-session-id)",
}


# Serve starts this instead of HAProxy itself (`cluster/ingress/haproxy.py`): stats page on
# loopback, and HAProxy dies with the proxy that started it. The image installs it as
# /usr/local/bin/loopserve-haproxy; `loopserve serve` finds it beside its own Python.
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
MIN_DRAINING_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
LAUNCHER = "loopserve-haproxy"


def launcher_path() -> Optional[str]:
    beside = Path(sys.executable).parent / LAUNCHER
    return str(beside) if os.access(beside, os.X_OK) else shutil.which(LAUNCHER)


def ingress_env(mode: IngressMode) -> dict[str, str]:
    """The cluster environment for an ingress mode."""
    return {**SERVE_FAST_PATH_ENV, **(HAPROXY_ENV if mode == "haproxy" else {})}


# For a cluster on one machine (what `loopserve serve`, the tests and the benchmarks start), where
# Ray's own processes share the cores with the engine. vLLM's CPU kernels run one OpenMP thread per
# core and meet at a barrier every layer, so a process that wakes on either core stalls both: a
# background load of 8% of one core in 1 ms bursts made vLLM's own server 17% slower (N=8 agent
# sessions, sum of turn latencies 764 -> 909 s), and an idle loopserve stack beside it cost about
# as much. Idle, that stack took ~12% of a core, nearly all periodic housekeeping; these settings
# lengthen the periods nobody on one machine needs short (idle: ~12% -> ~9% of a core):
# - Serve's control loop every 0.5 s, not 0.1 s (deploys and scaling react up to 0.4 s later);
# - Serve's cached request metrics flushed every 1 s, not 0.1 s (only their freshness changes);
# - Ray's log monitor re-lists the log folder every 5 s, not every 0.1 s (a new replica's log
#   reaches the driver's console up to 5 s later);
# - no task events (the dashboard's task table; there is no dashboard), Ray's own metrics every
#   30 s, the raylet's disk, GC and idle-worker checks every 1-5 s, no event-loop lag probe.
# Multi-node heads started with `ray start` keep Ray's and Serve's defaults.
LOCAL_CLUSTER_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_metrics_report_interval_ms": "30000",
    "RAY_local_fs_monitor_interval_ms": "5000",
    "RAY_raylet_check_gc_period_milliseconds": "1000",
    "RAY_kill_idle_workers_interval_ms": "2000",
    "RAY_io_context_event_loop_lag_collection_interval_ms": "-1",
}


def apply_ingress_env(mode: Optional[IngressMode]) -> None:
    """Set the mode's environment for a Ray cluster this process starts. `proxy` also
    clears the HAProxy switch, so an inherited environment cannot turn it on; None sets
    only the fast path and keeps whatever ingress the environment chose."""
    if mode == "proxy":
        for k in HAPROXY_ENV:
            os.environ.pop(k, None)
    for k, v in {**(ingress_env(mode) if mode else SERVE_FAST_PATH_ENV), **LOCAL_CLUSTER_ENV}.items():
        os.environ.setdefault(k, v)
    if mode == "haproxy":
        # A connection replica being stopped stays reachable this long so load balancers can
        # deregister it; then Serve closes its HTTP listener, and uvicorn ends its WebSockets
        # with 1012 whatever graceful_shutdown_timeout_s says. So this is also how long a turn in
        # flight gets to finish on a scale-down, a redeploy or a stop (actors/drain.py closes the
        # socket with 1001 once it has). Serve's default, 30 s, made every stop take 32 s even
        # idle; 2 s cut turns mid-stream (tests/cluster/test_haproxy.py). 10 s: an idle stop in
        # ~14 s, turns up to ~9 s finish. Set it higher for longer turns.
        os.environ.setdefault(MIN_DRAINING_ENV, "10")
    if mode == "haproxy" and HAPROXY_BINARY_ENV not in os.environ:
        launcher = launcher_path()
        if launcher is None:
            log.warning("%s is not installed: HAProxy's stats page binds every address and HAProxy can "
                        "outlive a killed server (pip install -e . installs it)", LAUNCHER)
        else:
            os.environ[HAPROXY_BINARY_ENV] = launcher


def haproxy_ingress() -> bool:
    """Is this cluster's ingress HAProxy (`RAY_SERVE_ENABLE_HA_PROXY=1` in its environment)?"""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0") == "1"
