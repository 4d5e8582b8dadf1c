"""Shared pieces of the benchmark scripts: a local cluster, app deployment, a WS loop."""

from __future__ import annotations

import json
import socket
import tempfile
import time
from typing import Optional


def start_cluster() -> str:
    import ray
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ls-bench-"), log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def stop_cluster() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def deploy(base: str, name: str, args: dict, timeout: float = 300) -> str:
    import httpx
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    url = f"{base}/{name}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not start")


async def ws_loop(url: str, turns: int, text: str, headers: Optional[dict] = None, store: bool = False) -> list[dict]:
    """One socket, `turns` chained creates; per turn: response id, client wall time, gap since last terminal."""
    from websockets.asyncio.client import connect

    rows = []
    async with connect(url.replace("http://", "ws://") + "/v1/responses", open_timeout=30, max_size=None,
                       additional_headers=headers or {}) as ws:
        prev, last_terminal = None, None
        for i in range(turns):
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": store,
                                      "previous_response_id": prev, "input": f"Turn {i:02d}: {text}"}))
            created_at = None
            while True:
                ev = json.loads(await ws.recv())
                if ev["type"] == "response.created":
                    created_at = time.perf_counter()
                if ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                    break
            if ev["type"] == "error":
                raise RuntimeError(ev)
            now = time.perf_counter()
            rows.append({"id": ev["response"]["id"], "wall_ms": (now - t0) * 1000,
                         "gap_ms": (created_at - last_terminal) * 1000 if last_terminal else None})
            last_terminal = now
            prev = ev["response"]["id"]
    return rows
