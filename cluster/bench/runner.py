"""`loopserve bench`: run the agent loop in every mode, print and save the numbers.

Without `--url` it starts a local Ray cluster with the scripted engine set up
like a GPU with prefix caching (decode 1,000 tokens/s; prefill 20,000 tokens/s
charged only for uncached tokens) and tears it down afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from cluster.bench.agent_loop import MODES, Loop, attach_server_timings, percentile, progress_bar, summarize
from cluster.bench.local import add_ingress_argument

SCRIPTED = {"tokens_per_second": 1000, "prefill_tokens_per_second": 20000, "max_output_tokens": 64}


def _local_cluster(args: dict[str, Any], ingress: str) -> str:
    from cluster.bench.local import deploy, start_local_serve

    # The echo route is the benchmark's floor: on for the benchmark's own app only.
    return deploy(start_local_serve(ingress=ingress), "bench", "/", {**args, "ops": {"echo_route": True}},
                  timeout=300)


async def echo_floor(url: str, n: int = 500) -> dict[str, float]:
    """Round trip of a small frame through the same Serve proxy (`/loopserve/echo`)."""
    from websockets.asyncio.client import connect

    times = []
    from cluster.bench.local import admin_headers

    async with connect(url.replace("http://", "ws://") + "/loopserve/echo", compression=None,
                       additional_headers=admin_headers()) as ws:
        for i in range(n):
            t0 = time.perf_counter()
            await ws.send('{"type":"ping","i":%d}' % i)
            await ws.recv()
            times.append(time.perf_counter() - t0)
    return {"p50_ms": percentile(times, 50) * 1000, "p99_ms": percentile(times, 99) * 1000}


def _server_cpu_seconds() -> float:
    """CPU seconds used so far by this machine's Ray worker processes (the server side)."""
    import psutil

    total = 0.0
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "ray::" in (p.info["name"] or "") or "ray::" in cmd or "ServeReplica" in cmd or "ProxyActor" in cmd:
                t = p.cpu_times()
                total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


async def concurrency_run(url: str, m: int, turns: int, size: int) -> dict[str, Any]:
    loops = [Loop(url, "websocket", turns, size) for _ in range(m)]
    cpu0, t0 = _server_cpu_seconds(), time.perf_counter()
    results = await asyncio.gather(*[lp.run() for lp in loops])
    elapsed, cpu = time.perf_counter() - t0, _server_cpu_seconds() - cpu0
    all_turns = [t for r in results for t in r]
    attach_server_timings(url, all_turns)
    over = [t.overhead_s for t in all_turns if t.overhead_s is not None]
    return {"sessions": m, "turns": len(all_turns), "turns_per_s": len(all_turns) / elapsed,
            "overhead_p50_ms": percentile(over, 50) * 1000, "overhead_p99_ms": percentile(over, 99) * 1000,
            "server_cpu_ms_per_turn": cpu / len(all_turns) * 1000}


def plot(summaries: list[dict[str, Any]], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summaries:
        pts = [(t["input_tokens"], t["overhead_s"] * 1000) for t in s["per_turn"] if t["overhead_s"] is not None]
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=s["mode"])
        b.plot([t["turn"] for t in s["per_turn"]], [t["wall_s"] * 1000 for t in s["per_turn"]], marker=".",
               label=s["mode"])
    a.set_xlabel("history (input tokens)")
    a.set_ylabel("server overhead per turn (ms)")
    a.set_title("Server overhead vs history")
    b.set_xlabel("turn")
    b.set_ylabel("turn time (ms)")
    b.set_title("Turn time")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="loopserve bench loop", description=__doc__)
    ap.add_argument("--url", help="a running loopserve (default: start a local scripted cluster)")
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--tool-output-bytes", type=int, default=2000, help="~2 KB; 20000 for file-read-sized outputs")
    ap.add_argument("--tool-delay", type=float, default=0.0, help="seconds the client 'runs' each tool")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--concurrency", default="", help="e.g. 1,8,64: concurrent WebSocket loops")
    ap.add_argument("--concurrency-turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every mode, alternating (medians, spread)")
    ap.add_argument("--out", default="bench_out")
    add_ingress_argument(ap)
    ns = ap.parse_args(argv)
    local = ns.url is None
    url = ns.url or _local_cluster({"engine": {"backend": "scripted", "scripted": SCRIPTED},
                                    "model": {"max_model_len": 262144}, "store": {"backend": "sqlite"}}, ns.ingress)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"url": url, "ingress": ns.ingress if local else "given", "turns": ns.turns, "tool_output_bytes": ns.tool_output_bytes,
                              "engine": "scripted" if local else "given", "modes": []}
    try:
        report["echo_floor"] = asyncio.run(echo_floor(url))
        modes = [m for m in ns.modes.split(",") if m]
        rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(max(1, ns.rounds)):
            # Alternate the order, so a noisy stretch of the shared machine hits every mode alike.
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                turns = asyncio.run(Loop(url, mode, ns.turns, ns.tool_output_bytes, ns.tool_delay,
                                         progress=progress_bar).run())
                attach_server_timings(url, turns)
                rounds[mode].append(summarize(mode, turns))
        report["rounds"] = rounds
        # the median round of each mode stands for it in the table and the plot
        report["modes"] = [sorted(runs, key=lambda x: x["loop_s"])[len(runs) // 2] for runs in rounds.values()]
        if ns.concurrency:
            report["concurrency"] = [asyncio.run(concurrency_run(url, int(m), ns.concurrency_turns,
                                                                 ns.tool_output_bytes))
                                     for m in ns.concurrency.split(",")]
    finally:
        if local:
            from cluster.bench.local import stop_local_serve

            stop_local_serve()
    print_report(report)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    png = plot(report["modes"], out / "overhead.png")
    print(f"\nsaved {out / 'report.json'}" + (f" and {png}" if png else ""))
    return 0


def print_report(report: dict[str, Any]) -> None:
    modes = report["modes"]
    base = next((m for m in modes if m["mode"] == "http-stateless"), None)
    print(f"\nagent loop: {report['turns']} turns, tool output {report['tool_output_bytes']} B, "
          f"final history {max((m['final_input_tokens'] for m in modes), default=0)} tokens")
    print(f"{'mode':15s} {'loop s':>8s} {'engine s':>8s} {'vs stateless':>12s} {'1st event p50/p99 ms':>21s} "
          f"{'1st token p50/p99 ms':>21s} {'overhead p50/p99 ms':>20s} {'early->late ms':>15s} {'KB sent':>8s}")
    for m in modes:
        ratio = f"{m['loop_s'] / base['loop_s']:.2f}x" if base else "-"
        print(f"{m['mode']:15s} {m['loop_s']:8.2f} {m.get('engine_s', 0.0):8.2f} {ratio:>12s} "
              f"{m['first_event_p50_ms']:9.1f}/{m['first_event_p99_ms']:<9.1f} "
              f"{m['first_token_p50_ms']:9.1f}/{m['first_token_p99_ms']:<9.1f} "
              f"{m['overhead_p50_ms']:8.1f}/{m['overhead_p99_ms']:<9.1f} "
              f"{m['overhead_early_ms']:6.1f}->{m['overhead_late_ms']:<6.1f} {m['bytes_sent_total'] / 1024:8.0f}")
    ws = next((m for m in modes if m["mode"] == "websocket"), None)
    if base and ws and ws.get("engine_s"):
        print(f"engine time alone bounds websocket/stateless at >= {ws['engine_s'] / base['loop_s']:.2f}x "
              f"(websocket spends {ws['loop_s'] - ws['engine_s']:.2f} s outside the engine, "
              f"stateless {base['loop_s'] - base['engine_s']:.2f} s)")
    rounds = report.get("rounds") or {}
    if rounds:
        n = len(next(iter(rounds.values())))
        print(f"\nclient-observed, {n} rounds (median [min-max]): loop time / the engine's own time, "
              "per-turn overhead beyond the engine, and where it went (p50 ms)")
        for mode, runs in rounds.items():
            ratio = [r["loop_s"] / r["engine_s"] for r in runs if r["engine_s"]]
            over = [r["overhead_p50_ms"] for r in runs]
            split = {k: statistics.median(r["split_p50_ms"][k] for r in runs) for k in runs[0]["split_p50_ms"]}
            print(f"  {mode:15s} loop/engine {statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]  "
                  f"overhead {statistics.median(over):6.2f} [{min(over):.1f}-{max(over):.1f}]  "
                  + "  ".join(f"{k} {v:.2f}" for k, v in split.items()))
    floor = report.get("echo_floor")
    if floor:
        print(f"WS echo through the same ingress ({report.get('ingress')}): p50 {floor['p50_ms']:.2f} ms, p99 {floor['p99_ms']:.2f} ms"
              + (f"; websocket overhead p50 = {ws['overhead_p50_ms'] / floor['p50_ms']:.1f}x the echo" if ws else ""))
    for c in report.get("concurrency", []):
        print(f"concurrency {c['sessions']:4d}: {c['turns_per_s']:7.1f} turns/s, overhead p50 "
              f"{c['overhead_p50_ms']:.1f} ms p99 {c['overhead_p99_ms']:.1f} ms, server CPU "
              f"{c['server_cpu_ms_per_turn']:.1f} ms/turn")
