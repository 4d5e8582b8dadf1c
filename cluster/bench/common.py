"""Shared pieces of the benchmark scripts: a local cluster, app deployment, a WS loop."""

from __future__ import annotations

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

    from cluster.bench.client import ws_turn, ws_url

    rows = []
    async with connect(ws_url(url), open_timeout=30, max_size=None, additional_headers=headers or {}) as ws:
        prev, last_terminal = None, None
        for i in range(turns):
            t0 = time.perf_counter()
            seen = await ws_turn(ws, {"model": "loopserve-tiny", "store": store, "previous_response_id": prev,
                                      "input": f"Turn {i:02d}: {text}"}, keep_events=False)
            response = seen.response
            rows.append({"id": response["id"], "wall_ms": seen.wall_s * 1000,
                         "gap_ms": (t0 + seen.created_s - last_terminal) * 1000 if last_terminal else None})
            last_terminal = t0 + seen.wall_s
            prev = response["id"]
    return rows
