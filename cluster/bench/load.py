"""Many concurrent WebSocket agent sessions: nothing lost, nothing duplicated, nothing leaked.

    python -m cluster.bench.load --sessions 1000 --turns 10      # starts a local scripted cluster
    python -m cluster.bench.load --url http://HOST:8000 ...      # or drives a running one

Each session opens a socket, chains `--turns` turns with `previous_response_id`
and checks every event it receives: it belongs to the response the session is
waiting for (response id, item ids of that response's output), sequence numbers
increase, exactly one terminal event per `response.create`. Prints sessions x
turns held, failures by kind, the server's per-turn overhead p50/p99 under the
load, and memory per idle session on the connection replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

from cluster.bench.client import ws_turn, ws_url
from cluster.bench.local import add_ingress_argument
from cluster.bench.local import stats as server_stats
from cluster.core.events import TERMINAL_EVENTS


class SessionResult:
    def __init__(self) -> None:
        self.turns = 0
        self.problems: Counter[str] = Counter()
        self.response_ids: list[str] = []
        self.latencies: list[float] = []  # client-observed seconds per measured turn (send -> terminal)


async def _turn(ws, body: dict[str, Any], result: SessionResult) -> str | None:
    seen = await ws_turn(ws, body, timeout=300)
    if not seen.ok:  # refused before it was created
        result.problems[f"error:{seen.last['error'].get('code')}"] += 1
        return None
    rid, seq, items = None, -1, set()
    for ev in seen.events:
        kind = ev["type"]
        if ev.get("sequence_number", seq + 1) <= seq:
            result.problems["sequence_not_increasing"] += 1
        seq = ev.get("sequence_number", seq)
        if kind == "response.created":
            rid = ev["response"]["id"]
        elif "response" in ev and ev["response"]["id"] != rid:
            result.problems["event_of_another_response"] += 1
        if "item_id" in ev:
            items.add(ev["item_id"])
        if kind in TERMINAL_EVENTS:
            output_ids = {o["id"] for o in ev["response"]["output"]}
            if not items <= output_ids:
                result.problems["item_of_another_response"] += 1
            if kind != "response.completed":
                result.problems[f"terminal:{kind}"] += 1
            break
    # Nothing more may arrive for this response (a duplicate terminal would show here).
    try:
        extra = await asyncio.wait_for(ws.recv(), 0.001)
        result.problems[f"unexpected_event:{json.loads(extra)['type']}"] += 1
    except asyncio.TimeoutError:
        pass
    return rid


async def session(url: str, n: int, turns: int, go: asyncio.Event, handshakes: asyncio.Semaphore,
                  results: list[SessionResult], pause: tuple[float, float] = (0.0, 0.0)) -> None:
    from websockets.asyncio.client import connect

    result = SessionResult()
    results.append(result)
    async with handshakes:
        ws = await connect(ws_url(url), open_timeout=120, close_timeout=5,
                           compression=None, ping_interval=None, max_size=None)
    try:
        # One warm turn so the idle session holds a cached response (what memory per session measures).
        prev = await _turn(ws, {"model": "loopserve-tiny", "input": f"session {n}: start"}, result)
        result.response_ids.append(prev or "")
        await go.wait()
        rng = random.Random(n)  # the same pauses every run
        for i in range(turns):
            if pause[1] > 0:
                # The client running its tool; the first wait spreads the sessions' starts over one
                # pause (agents do not start in lockstep: a burst of every session at once is the
                # closed loop's test, not this one's).
                await asyncio.sleep(rng.uniform(*pause) if i else rng.uniform(0, pause[1]))
            body = {"model": "loopserve-tiny", "input": f"session {n} turn {i}: next step"}
            if prev:
                body["previous_response_id"] = prev
            t0 = time.perf_counter()
            rid = await _turn(ws, body, result)
            result.latencies.append(time.perf_counter() - t0)
            if rid is not None:
                result.turns += 1
                result.response_ids.append(rid)
                prev = rid
    except Exception as exc:  # a broken socket is a failure to report, not a crash of the run
        result.problems[f"exception:{type(exc).__name__}"] += 1
    finally:
        await ws.close()


async def run_load(url: str, sessions: int, turns: int, pause: tuple[float, float] = (0.0, 0.0)) -> dict[str, Any]:
    """`pause`: seconds each session waits between its turns (uniform), as an agent runs its tools;
    (0, 0) is a closed loop, every session sending its next turn at once (a throughput test)."""

    def stats() -> dict[str, Any]:
        return server_stats(url, last=1024)

    base = await asyncio.to_thread(stats)
    results: list[SessionResult] = []
    go = asyncio.Event()
    handshakes = asyncio.Semaphore(64)
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(session(url, n, turns, go, handshakes, results, pause))
             for n in range(sessions)]
    while sum(1 for r in results if r.response_ids) + sum(1 for t in tasks if t.done()) < sessions:
        await asyncio.sleep(0.2)
    opened_s = time.perf_counter() - t0
    idle = await asyncio.to_thread(stats)
    import os

    from cluster.bench.processes import CpuMeter

    meter = CpuMeter(lambda: {os.getpid(): "bench client"})  # this machine's processes: a local run's servers too
    meter.start()
    t1 = time.perf_counter()
    go.set()
    overheads: list[float] = []

    async def sample() -> None:  # the server keeps the last 1,024 turn timings: sample them while it runs
        while not all(t.done() for t in tasks):
            await asyncio.sleep(2)
            for t in (await asyncio.to_thread(stats))["turns"]:
                if t["response_id"] not in sampled:
                    sampled.add(t["response_id"])
                    overheads.append((t["total"] - t["engine"]) * 1000)

    sampled: set[str] = set()
    sampler = asyncio.create_task(sample())
    await asyncio.gather(*tasks)
    run_s = time.perf_counter() - t1
    cpu = meter.stop()
    sampler.cancel()
    loop_end, loop_idle = (await asyncio.to_thread(stats)).get("loop") or {}, idle.get("loop") or {}
    problems: Counter[str] = Counter()
    for r in results:
        problems.update(r.problems)
    all_ids = [rid for r in results for rid in r.response_ids if rid]
    if len(all_ids) != len(set(all_ids)):
        problems["duplicate_response_ids"] += len(all_ids) - len(set(all_ids))
    overheads.sort()

    def pct(p: float) -> float:
        return overheads[min(len(overheads) - 1, int(p / 100 * len(overheads)))] if overheads else float("nan")

    latencies = sorted(x for r in results for x in r.latencies)

    def client_pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1000 if latencies else float("nan")

    rss0, rss1 = base.get("rss_bytes"), idle.get("rss_bytes")
    return {
        "sessions": sessions, "turns_per_session": turns, "pause_s": list(pause),
        "turns_completed": sum(r.turns for r in results), "turns_expected": sessions * turns,
        "problems": dict(problems), "open_s": opened_s, "run_s": run_s,
        "turns_per_s": sum(r.turns for r in results) / run_s if run_s else 0.0,
        "overhead_p50_ms": pct(50), "overhead_p99_ms": pct(99), "overhead_samples": len(overheads),
        "turn_latency_p50_ms": client_pct(50), "turn_latency_p99_ms": client_pct(99),
        # CPU each kind of process spent per completed turn (process CPU time over the run / turns)
        "cpu_ms_per_turn": {k: round(v * 1000 / max(1, sum(r.turns for r in results)), 2) for k, v in cpu.items()},
        # how long the connection replica's event loop was held during the run, and its full GCs
        "loop": {k: (round(v - loop_idle.get(k, 0), 3) if not k.endswith("max_s") else v)
                 for k, v in loop_end.items() if isinstance(v, (int, float))},
        "idle_sockets": idle.get("open_sockets"),
        "rss_per_idle_session_bytes": (rss1 - rss0) / sessions if rss0 and rss1 else None,
        "cache_bytes_per_idle_session": idle.get("ws_cache_bytes", 0) / sessions,
    }


def print_load(r: dict[str, Any]) -> None:
    print(f"\n{r['sessions']} sessions x {r['turns_per_session']} turns (tool pauses {r['pause_s']} s): {r['turns_completed']}/{r['turns_expected']} "
          f"completed in {r['run_s']:.1f} s ({r['turns_per_s']:.1f} turns/s; sockets opened in {r['open_s']:.1f} s)")
    print(f"problems (lost, duplicated, leaked, errors): {r['problems'] or 'none'}")
    print(f"client-observed turn latency: p50 {r['turn_latency_p50_ms']:.0f} ms, p99 {r['turn_latency_p99_ms']:.0f} ms")
    print("CPU per turn (ms): " + ", ".join(f"{k} {v}" for k, v in r["cpu_ms_per_turn"].items()))
    print(f"connection replica's event loop during the run: {r['loop']}")
    print(f"server overhead under load: p50 {r['overhead_p50_ms']:.1f} ms, p99 {r['overhead_p99_ms']:.1f} ms "
          f"({r['overhead_samples']} turns sampled)")
    if r["rss_per_idle_session_bytes"] is not None:
        print(f"idle sessions: {r['idle_sockets']} open; connection replica RSS +{r['rss_per_idle_session_bytes'] / 1024:.1f} "
              f"KiB per session; session caches {r['cache_bytes_per_idle_session'] / 1024:.1f} KiB per session")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="loopserve bench load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--pause", default="0,0", help="tool pause between a session's turns, 'min,max' seconds "
                                                   "(uniform); 0,0: closed loop")
    ap.add_argument("--safety", choices=["on", "off"], default="off",
                    help="the default classifiers, inline in the connection replica")
    add_ingress_argument(ap)
    ns = ap.parse_args(argv)
    url = ns.url
    if url is None:
        from cluster.bench.local import deploy, start_local_serve

        app = {**LOAD_APP, "safety": {"enabled": ns.safety == "on"}}
        url = deploy(start_local_serve(ingress=ns.ingress), "load", "/", app)
    try:
        lo, hi = (float(x) for x in ns.pause.split(","))
        report = asyncio.run(run_load(url, ns.sessions, ns.turns, (lo, hi)))
    finally:
        if ns.url is None:
            from cluster.bench.local import stop_local_serve

            stop_local_serve()
    print_load(report)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)


# The app the load runs against: the scripted engine (fast: the API layer is what is loaded),
# connection replicas that accept thousands of sockets (each is an ongoing request).
LOAD_APP: dict[str, Any] = {
    "engine": {"backend": "scripted", "scripted": {"tokens_per_second": 100_000, "max_output_tokens": 16,
                                                   "answer_text": "done."}},
    "store": {"backend": "none"},
    "safety": {"enabled": False},
    "connection": {"num_cpus": 0.05, "max_ongoing_requests": 5000},
    "render": {"num_cpus": 0.05}, "engine_deployment": {"num_cpus": 0.05, "max_ongoing_requests": 5000},
}

if __name__ == "__main__":
    main()
