"""Side-by-side configurations of the same app, measured from the client.

`python -m cluster.bench.variants --turns 50 --rounds 3` deploys each variant as
its own app on one local cluster (scripted engine set up like a GPU: decode 1,000
tokens/s, prefill 20,000 tokens/s of uncached tokens), then runs the WebSocket
agent loop on each in turn, round after round (alternating, so machine noise
hits all alike), and prints per variant: the loop time over the engine's own
time (the engine replica's clock), the per-turn overhead the client saw beyond
the engine (p50) and where it went, next to a bare WebSocket echo through the
same ingress. Default variants: safety classifiers inline in the connection
replica vs on the SafetyActor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from cluster.bench.agent_loop import Loop, attach_server_timings, percentile, summarize
from cluster.bench.local import add_ingress_argument, deploy, start_local_serve, stop_local_serve
from cluster.bench.runner import SCRIPTED, echo_floor

DEFAULT_VARIANTS = {
    "safety-inline": {"safety": {"placement": "inline"}},
    "safety-actor": {"safety": {"placement": "actor"}},
}


def _app(extra: dict[str, Any]) -> dict[str, Any]:
    base = {"engine": {"backend": "scripted", "scripted": SCRIPTED}, "model": {"max_model_len": 262144},
            "store": {"backend": "sqlite"}, "ops": {"echo_route": True}}
    for key, value in extra.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def run(variants: dict[str, dict[str, Any]], turns: int, rounds: int, tool_output_bytes: int,
        ingress: str = "haproxy") -> dict[str, Any]:
    base = start_local_serve(ingress=ingress)
    try:
        urls = {name: deploy(base, name.replace(".", "-"), f"/{name}", _app(extra), timeout=300)
                for name, extra in variants.items()}
        floor = asyncio.run(echo_floor(next(iter(urls.values())), n=300))
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for r in range(rounds):
            for name, url in (list(urls.items()) if r % 2 == 0 else list(reversed(urls.items()))):
                loop_turns = asyncio.run(Loop(url, "websocket", turns, tool_output_bytes).run())
                attach_server_timings(url, loop_turns)
                summary = summarize(name, loop_turns)
                summary["overhead_p50_ms"] = percentile([t.overhead_s for t in loop_turns[1:]], 50) * 1000
                results[name].append(summary)
        return {"echo_floor": floor, "ingress": ingress, "turns": turns, "rounds": rounds, "variants": results}
    finally:
        stop_local_serve()


def report(out: dict[str, Any]) -> None:
    floor = out["echo_floor"]["p50_ms"]
    print(f"WebSocket echo through the same ingress ({out.get('ingress')}): p50 {floor:.2f} ms "
          f"({out['rounds']} rounds x {out['turns']} turns per variant, alternating)")
    print(f"{'variant':16s} {'loop/engine':>18s} {'overhead p50 ms':>18s} {'x echo':>7s}   "
          "split p50 ms (outside server | connection | render | safety wait | engine hop)")
    for name, runs in out["variants"].items():
        ratios = [r["loop_s"] / r["engine_s"] for r in runs if r["engine_s"]]
        over = [r["overhead_p50_ms"] for r in runs]
        split = {k: statistics.median(r["split_p50_ms"][k] for r in runs) for k in runs[0]["split_p50_ms"]}
        print(f"{name:16s} {statistics.median(ratios):6.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
              f"{statistics.median(over):7.2f} [{min(over):.1f}-{max(over):.1f}] "
              f"{statistics.median(over) / floor:6.1f}x   " + " | ".join(f"{v:.2f}" for v in split.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loopserve bench variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tool-output-bytes", type=int, default=2000)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help='e.g. inline=\'{"safety": {"placement": "inline"}}\' (repeatable)')
    ap.add_argument("--json", help="also write the results here")
    add_ingress_argument(ap)
    ns = ap.parse_args(argv)
    variants = dict(v.split("=", 1) for v in ns.variant)
    variants = {k: json.loads(v) for k, v in variants.items()} or DEFAULT_VARIANTS
    out = run(variants, ns.turns, ns.rounds, ns.tool_output_bytes, ns.ingress)
    report(out)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
