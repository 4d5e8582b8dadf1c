"""What `store: true` costs a turn: the store write is post-inference work.

    python -m cluster.bench.store_latency --turns 30

Three apps in one run (scripted engine): no store, SQLite, PostgreSQL
(127.0.0.1:5432). Prints per-turn wall time p50 (client side) and the store
write p50 (server side) for each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile

from cluster.bench.common import deploy, start_cluster, stop_cluster, ws_loop
from cluster.bench.local import stats as server_stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="loopserve bench store-latency", description=__doc__)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ns = ap.parse_args(argv)
    base = start_cluster()
    apps = {
        "nostore": {"store": {"backend": "none"}},
        "sqlite": {"store": {"backend": "sqlite", "sqlite_path": tempfile.mktemp(suffix=".db")}},
        "postgres": {"store": {"backend": "postgres", "postgres_dsn": ns.dsn}},
    }
    results = {}
    try:
        urls = {name: deploy(base, name, {"engine": {"backend": "scripted"}, **cfg}) for name, cfg in apps.items()}
        for name, url in urls.items():
            rows = asyncio.run(ws_loop(url, ns.turns, "please read the next file and report. " * 4, store=True))
            stats = server_stats(url)
            results[name] = (rows, stats)
    finally:
        stop_cluster()
    print(f"turns={ns.turns}, one WebSocket each, store: true")
    for name, (rows, stats) in results.items():
        walls = [r["wall_ms"] for r in rows[1:]]
        w = stats["store_writes"]
        print(f"{name:9s} turn wall p50 {statistics.median(walls):7.2f} ms   store writes {w['count']:3d}, "
              f"write p50 {w['p50_ms'] if w['p50_ms'] is None else round(w['p50_ms'], 2)} ms   "
              f"post_work {stats['post_work']}")


if __name__ == "__main__":
    main()
