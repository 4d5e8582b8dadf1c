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


# Serve starts this instead of HAProxy itself (`cluster/haproxy_launcher.py`): stats page on
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


# For a cluster on one machine (what `loopserve serve` and the benchmarks start), where Serve's
# controller shares the cores with the engine: its control loop every 0.5 s instead of 0.1 s.
# Measured (N=8 agent sessions on the real engine, 2 cores): the controller used ~3% of a core;
# turn p50 7.11 -> 6.66-6.74 s, all sessions done 97.6 -> 94.4-95.1 s. Deploys and scaling
# decisions react up to 0.4 s later. Multi-node heads (num-cpus 0) keep Serve's default.
LOCAL_CLUSTER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


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
