"""Safety cost per turn over a 30-turn loop, and what a slow post-work hook costs the next turn.

    python -m bench.safety_loop --turns 30

Two apps in one run on the scripted engine, both with the default SafetyActor
(profanity model + policy): `plain`, and `slowhook` with a 1 s post-inference
hook. Prints, per turn: characters classified (input, output), the input
check's time, and the gap between the client receiving the terminal event and
receiving the next turn's `response.created`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time


async def loop(url: str, turns: int) -> list[dict]:
    from websockets.asyncio.client import connect

    rows = []
    async with connect(url.replace("http://", "ws://") + "/v1/responses", open_timeout=30, max_size=None) as ws:
        prev, last_terminal = None, None
        for i in range(turns):
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                      "previous_response_id": prev,
                                      "input": f"Turn {i:02d}: please look at the next module and summarise it. " * 3}))
            created_at = None
            while True:
                ev = json.loads(await ws.recv())
                if ev["type"] == "response.created":
                    created_at = time.perf_counter()
                if ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                    break
            gap = (created_at - last_terminal) * 1000 if last_terminal else None
            last_terminal = time.perf_counter()
            prev = ev["response"]["id"]
            rows.append({"id": prev, "gap_ms": gap})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=30)
    ns = ap.parse_args()
    import httpx
    import ray
    from ray import serve

    from cluster.app import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ls-bench-"), log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = {"engine": {"backend": "scripted"}, "safety": {"policy": {"secrets": ["BEGIN RSA PRIVATE KEY"]}}}
    serve.run(build_app(base), name="plain", route_prefix="/plain", blocking=False)
    serve.run(build_app({**base, "post_work": {"hooks": ["bench.hooks:slow_hook"]}}), name="slowhook",
              route_prefix="/slowhook", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        for name in ("plain", "slowhook"):
            for _ in range(240):
                try:
                    if httpx.get(f"{url}/{name}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        results = {}
        for name in ("plain", "slowhook"):
            rows = asyncio.run(loop(f"{url}/{name}", ns.turns))
            stats = httpx.get(f"{url}/{name}/loopserve/stats", params={"last": 1024}, timeout=30).json()
            by_id = {t["response_id"]: t for t in stats["turns"]}
            results[name] = (rows, by_id, stats)
    finally:
        serve.shutdown()
        ray.shutdown()
    rows, by_id, stats = results["plain"]
    print(f"turns={ns.turns} (plain app)")
    print("turn  input_chars  output_chars  safety_input_ms  first_token_ms  total_ms")
    for i, r in enumerate(rows, 1):
        t = by_id[r["id"]]
        print(f"{i:4d}  {t['safety_input_chars']:11d}  {t['safety_output_chars']:12d}  "
              f"{t['safety_input_ms']:15.2f}  {t['first_token']*1000:14.2f}  {t['total']*1000:8.2f}")
    print("safety actor:", stats["safety"], "post_work:", stats["post_work"])
    for name in ("plain", "slowhook"):
        gaps = [r["gap_ms"] for r in results[name][0] if r["gap_ms"] is not None]
        pw = results[name][2]["post_work"]
        print(f"{name:9s} terminal -> next response.created: p50 {statistics.median(gaps):.2f} ms, "
              f"max {max(gaps):.2f} ms; post_work {pw}")


if __name__ == "__main__":
    main()
