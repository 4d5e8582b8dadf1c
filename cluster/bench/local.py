"""A local Ray cluster with Serve on a free port, and app deployment (benchmarks, tests)."""

from __future__ import annotations

import socket
import tempfile
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_serve(num_cpus: int = 4, temp_dir: str | None = None) -> str:
    """ray.init (own temp dir, free ports: never Redis's 6379) + serve.start; returns the base URL."""
    import os

    import ray
    from ray import serve

    from ..app import SERVE_FAST_PATH_ENV

    # The proxy reads these at start from the cluster's environment.
    for k, v in SERVE_FAST_PATH_ENV.items():
        os.environ.setdefault(k, v)
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


def deploy(base: str, name: str, prefix: str, args: dict[str, Any], timeout: float = 300) -> str:
    """Deploy a loopserve app under `prefix` and wait until it answers."""
    from ray import serve

    from ..app import build_app

    serve.run(build_app(args), name=name, route_prefix=prefix, blocking=False)
    return wait_healthy(base + (prefix if prefix != "/" else ""), timeout)
