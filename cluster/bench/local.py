"""A local Ray cluster with Serve on a free port, and app deployment (benchmarks, tests)."""

from __future__ import annotations

import random
import socket
import tempfile
import time
from typing import Any, Optional

from cluster.ingress.modes import IngressMode, apply_ingress_env

# Ports nothing hands out on its own while a cluster starts. The kernel's ephemeral range
# (32768-60999 by default) is where bind(0) and outgoing connections land, Ray picks its agents'
# ports at random from there up to 65535, its workers take 10002-19999 and Serve's direct ingress
# 30000-31000. A port drawn from the ephemeral range could be taken by the very cluster it was
# chosen for before HAProxy binds it ("cannot bind socket": seen on CI).
QUIET_PORTS = range(20000, 30000)


def free_port() -> int:
    """A port free now, outside every range the kernel or Ray allocate from by themselves."""
    for _ in range(200):
        port = random.choice(QUIET_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {QUIET_PORTS.start}-{QUIET_PORTS.stop - 1}")


def add_ingress_argument(ap) -> None:
    """`--ingress`: how the local cluster a benchmark starts is reached (cluster/ingress/modes.py)."""
    ap.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                    help="HAProxy (loopserve's default) or Serve's Python proxy, for the local cluster")


def start_local_serve(num_cpus: int = 4, temp_dir: str | None = None, ingress: Optional[IngressMode] = None) -> str:
    """ray.init (own temp dir, free ports: never Redis's 6379) + serve.start; returns the base URL.

    `ingress` applies to the Ray cluster this starts (a cluster-wide setting, see
    cluster/ingress/modes.py); None keeps what the environment says (Serve's proxy unless set)."""
    import ray
    from ray import serve

    apply_ingress_env(ingress)  # the proxy reads these at start from the cluster's environment
    port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             _temp_dir=temp_dir or tempfile.mkdtemp(prefix="loopserve-ray-"))
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def wait_healthy(url: str, timeout: float) -> str:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f}s")


# The operator key of locally deployed apps (benchmarks, tests): `deploy` adds its
# digest to `auth.admin_keys`, so `/loopserve/stats` answers them. A production
# config names its own admin keys (or none: the ops routes are then closed).
LOCAL_ADMIN_KEY = "sk-loopserve-local-admin"


def admin_headers() -> dict[str, str]:
    """For an app started elsewhere, set LOOPSERVE_ADMIN_KEY to one of its admin keys."""
    import os

    return {"authorization": f"Bearer {os.environ.get('LOOPSERVE_ADMIN_KEY') or LOCAL_ADMIN_KEY}"}


def stats(url: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
    """`/loopserve/stats` of an app deployed by `deploy` (counters and per-turn server timings)."""
    import httpx

    r = httpx.get(url + "/loopserve/stats", params=params, headers=admin_headers(), timeout=timeout)
    r.raise_for_status()
    return r.json()


def with_local_admin(args: dict[str, Any]) -> dict[str, Any]:
    from cluster.auth import key_sha256

    auth = dict(args.get("auth") or {})
    auth["admin_keys"] = sorted({*auth.get("admin_keys", []), key_sha256(LOCAL_ADMIN_KEY)})
    return {**args, "auth": auth}


def deploy(base: str, name: str, prefix: str, args: dict[str, Any], timeout: float = 300, admin: bool = True) -> str:
    """Deploy a loopserve app under `prefix` (with the local admin key) and wait until it answers."""
    from cluster.app import run_app

    run_app(with_local_admin(args) if admin else args, name, prefix)  # DeployFailed names the replicas' errors
    return wait_healthy(base + (prefix if prefix != "/" else ""), timeout)
