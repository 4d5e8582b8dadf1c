"""Safety cost per turn over a 30-turn loop, and what a slow post-work hook costs the next turn.

    python -m cluster.bench.safety_loop --turns 30

Two apps in one run on the scripted engine, both with the default SafetyActor
(profanity model + policy): `plain`, and `slowhook` with a 1 s post-inference
hook. Prints, per turn: characters classified (input, output), the input
check's time, and the gap between the client receiving the terminal event and
receiving the next turn's `response.created`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from cluster.bench.common import deploy, start_cluster, stop_cluster, ws_loop
from cluster.bench.local import stats as server_stats

TEXT = "please look at the next module and summarise it. " * 3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="loopserve bench safety-loop", description=__doc__)
    ap.add_argument("--turns", type=int, default=30)
    ns = ap.parse_args(argv)

    base_cfg = {"engine": {"backend": "scripted"}, "safety": {"policy": {"secrets": ["BEGIN RSA PRIVATE KEY"]}}}
    url = start_cluster()
    results = {}
    try:
        urls = {"plain": deploy(url, "plain", base_cfg),
                "slowhook": deploy(url, "slowhook", {**base_cfg, "post_work": {"hooks": ["cluster.bench.hooks:slow_hook"]}})}
        for name, app_url in urls.items():
            rows = asyncio.run(ws_loop(app_url, ns.turns, TEXT))
            stats = server_stats(app_url, last=1024)
            results[name] = (rows, {t["response_id"]: t for t in stats["turns"]}, stats)
    finally:
        stop_cluster()
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
