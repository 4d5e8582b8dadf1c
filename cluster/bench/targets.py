"""The hot-path targets in one command, each measured where the client sees it.

    python -m cluster.bench.targets [--out bench_out/targets]

Runs, one after the other, each in its own process and local Ray cluster (the
default ingress, HAProxy):
1. the scripted engine at GPU-like speed, a 50-turn WebSocket loop with ~2 KB tool
   outputs, 3 rounds: loop time over the engine's own time, per-turn overhead vs a
   bare WebSocket echo through the same ingress (`loopserve bench`);
2. 300 concurrent WebSocket sessions x 5 turns, safety on (`cluster.bench.load`);
3. the real engine (vLLM on CPU, the tiny model), 50 turns of +800 characters (what fits the tiny model's 32k context in 50 turns):
   the engine alone, loopserve's WebSocket loop, vLLM's own server (`vllm_compare`).
Prints the table (target, value, met) and writes `targets.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def _run(args: list[str]) -> None:
    print("+ python -m " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", *args], check=True)


def measure(out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    _run(["cluster.bench", "--turns", "50", "--rounds", "3", "--modes", "websocket", "--out", str(out / "loop")])
    _run(["cluster.bench.load", "--sessions", "300", "--turns", "5", "--safety", "on", "--out", str(out / "load.json")])
    _run(["cluster.bench.vllm_compare", "--turns", "50", "--message-chars", "800", "--out", str(out / "real")])
    return {"loop": json.loads((out / "loop" / "report.json").read_text()),
            "load": json.loads((out / "load.json").read_text()),
            "real": json.loads((out / "real" / "vllm_compare.json").read_text())["turn_seconds"]}


def table(m: dict[str, Any]) -> list[tuple[str, str, bool]]:
    runs = m["loop"]["rounds"]["websocket"]
    ratios = [r["loop_s"] / r["engine_s"] for r in runs]
    over = statistics.median(r["overhead_p50_ms"] for r in runs)
    echo = m["loop"]["echo_floor"]["p50_ms"]
    load, real = m["load"], m["real"]
    floor, ws, peer = sum(real["floor"]), real["loopserve-ws"], real.get("vllm-server")
    rows = [
        ("scripted WS loop / engine time <= 1.15x",
         f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]", statistics.median(ratios) <= 1.15),
        ("WS overhead p50 <= 2x a WS echo through the same ingress",
         f"{over:.2f} ms vs echo {echo:.2f} ms = {over / echo:.1f}x", over <= 2 * echo),
        ("real engine: 50-turn WS loop <= 1.05x the engine floor",
         f"{sum(ws):.2f} s vs {floor:.2f} s = {sum(ws) / floor:.2f}x", sum(ws) <= 1.05 * floor),
    ]
    if peer:
        rows.append(("real engine: WS turns 1-5 <= vLLM's own server",
                     f"{sum(ws[:5]) * 1000:.0f} ms vs {sum(peer[:5]) * 1000:.0f} ms", sum(ws[:5]) <= sum(peer[:5])))
    rows += [
        ("load 300x5, safety on: >= 100 turns/s", f"{load['turns_per_s']:.1f} turns/s", load["turns_per_s"] >= 100),
        ("load: p99 turn latency < 1.5 s (client)", f"{load['turn_latency_p99_ms']:.0f} ms",
         load["turn_latency_p99_ms"] < 1500),
        ("load: nothing lost", f"{load['turns_completed']}/{load['turns_expected']}, problems {load['problems'] or 'none'}",
         load["turns_completed"] == load["turns_expected"] and not load["problems"]),
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loopserve bench targets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out/targets")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    m = measure(out)
    rows = table(m)
    print("\n| target | value (this run) | met |\n|---|---|---|")
    for name, value, met in rows:
        print(f"| {name} | {value} | {'yes' if met else 'no'} |")
    (out / "targets.json").write_text(json.dumps({"rows": rows, "measured": m}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
