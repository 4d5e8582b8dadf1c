"""Shared pieces of the benchmark scripts: a local cluster, app deployment, a WS loop."""

from __future__ import annotations

import json
import time
from typing import Optional


def start_cluster() -> str:
    from cluster.bench.local import start_local_serve

    return start_local_serve()


def stop_cluster() -> None:
    from cluster.bench.local import stop_local_serve

    stop_local_serve()


def deploy(base: str, name: str, args: dict, timeout: float = 300) -> str:
    from cluster.bench import local

    return local.deploy(base, name, f"/{name}", args, timeout)


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
