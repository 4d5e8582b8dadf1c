"""Hostile clients beside honest agent sessions, through HAProxy: `python -m cluster.bench.adversarial`.

The target of the second hardening round (issue 46): 64 hostile clients (16 of each kind in
`hostile.py`: decompression-bomb images, queued creates of many small items, large and complex
bodies, long stored chains read back and /health floods) beside 8 honest agent sessions over
WebSocket, on the scripted engine with a vision model's renderer (the built-in tiny Idefics3), a
SQLite store and API keys. One run, two phases: the honest sessions alone, then with the hostile
clients. Reported: the honest sessions' p99 turn in each phase and their ratio (target <= 3), every
replica's peak RSS against its ceiling, replica restarts (target 0), and what the hostile clients
were answered.

    python -m cluster.bench.adversarial --out bench_out/adversarial
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

from cluster.bench.hostile import run_hostile

HONEST_KEY, HOSTILE_KEY = "sk-adversarial-honest", "sk-adversarial-hostile"
MODEL = "loopserve-tiny-vision"
MiB = 1024 * 1024


def app_args(store_path: str, hostile_limited: bool) -> dict[str, Any]:
    from cluster.auth import key_sha256

    # Limited: the hostile key has the defaults (600 creates, 3,000 reads a minute), the designed
    # defence of the replicas' CPU. Unlimited: a tenant whose plan allows a lot, so what reaches
    # the server is what the bounds below the rate limits must hold.
    hostile = {} if hostile_limited else {"max_connections": 10_000, "requests_per_minute": 1_000_000,
                                          "reads_per_minute": 1_000_000}

    return {
        "model": {"name": MODEL, "builtin": MODEL, "max_model_len": 32768,
                  "images": {"max_per_context": 8, "max_image_bytes": 8 * MiB}},
        "engine": {"backend": "scripted", "scripted": {"tokens_per_second": 400, "prefill_tokens_per_second": 20000}},
        "store": {"backend": "sqlite", "sqlite_path": store_path},
        "auth": {"keys": [{"sha256": key_sha256(HONEST_KEY), "tenant": "honest"},
                          {"sha256": key_sha256(HOSTILE_KEY), "tenant": "hostile", **hostile}]},
        "connection": {"ray_actor_options": {"num_cpus": 0.25}, "max_ongoing_requests": 400},
        "render": {"ray_actor_options": {"num_cpus": 0.25}},
        "engine_deployment": {"ray_actor_options": {"num_cpus": 0.25}},
    }


def ceilings(args: dict[str, Any]) -> dict[str, int]:
    """What each replica may grow by (beyond its idle RSS), from the documented bounds, doubled for
    Python's object overhead: the connection replica's replica-wide queues, held steering/injected
    bytes, the registry of stored responses and HTTP bodies in flight; the engine's decoded images."""
    from cluster.config import LoopserveConfig

    cfg = LoopserveConfig.model_validate(args)
    ws, cache, limits = cfg.websocket, cfg.cache, cfg.limits
    conn = ws.max_replica_queued_bytes + ws.max_replica_held_bytes + cache.replica_max_bytes \
        + cache.connections_max_bytes + 16 * limits.max_request_bytes
    return {"ConnectionActor": 2 * conn, "EngineReplica": 2 * 256 * MiB, "RenderActor": 2 * 256 * MiB}


def replicas() -> dict[str, tuple[int, str]]:
    """Live Serve replica processes on this machine: key -> (pid, deployment), from their process
    titles (`ray::ServeReplica:<app>:<deployment>`); a restarted replica is a new pid."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::ServeReplica:"):
            out[f"{title}#{entry.name}"] = (int(entry.name), title.split(":")[-1].strip())
    return out


def rss(pid: int, field: str = "VmHWM") -> int:
    """A process's resident memory from /proc: its peak (VmHWM) or now (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


async def honest(base: str, sessions: int, turns: int, tool_s: float) -> list[float]:
    from cluster.bench.agent_loop import Loop

    loops = [Loop(base, "websocket", turns, 600, tool_delay_s=tool_s, model=MODEL, api_key=HONEST_KEY)
             for _ in range(sessions)]
    results = await asyncio.gather(*(loop.run() for loop in loops))
    return [t.wall_s for turns_ in results for t in turns_]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.bench.adversarial", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8, help="honest agent sessions")
    ap.add_argument("--turns", type=int, default=20, help="turns of each honest session")
    ap.add_argument("--tool-s", type=float, default=2.0, help="an honest session's tool time between turns")
    ap.add_argument("--per-kind", type=int, default=16, help="hostile clients of each kind (4 kinds)")
    ap.add_argument("--warm-s", type=float, default=10.0, help="hostile clients start this long before the honest ones")
    ap.add_argument("--unlimited", action="store_true",
                    help="the hostile key without rate limits (memory and restarts; CPU is then shared freely)")
    ap.add_argument("--out", default="bench_out/adversarial")
    ns = ap.parse_args(argv)

    from cluster.bench import local

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    args = app_args(str(out / "store.sqlite3"), hostile_limited=not ns.unlimited)
    base = local.start_local_serve(ingress="haproxy")
    try:
        url = local.deploy(base, "adversarial", "/", args)
        before = replicas()
        idle = {aid: rss(pid, "VmRSS") for aid, (pid, _) in before.items()}
        asyncio.run(honest(url, 2, 2, 0.0))  # warm: models loaded, first renders done
        alone = asyncio.run(honest(url, ns.sessions, ns.turns, ns.tool_s))
        print(f"honest alone: {len(alone)} turns, p99 {p99(alone):.2f} s")
        ctx = multiprocessing.get_context("spawn")
        queue: Any = ctx.Queue()
        done = ctx.Event()
        attack_s = ns.warm_s + 3 * (max(alone) + ns.tool_s) * ns.turns + 60  # outlasts the honest run under attack
        child = ctx.Process(target=run_hostile, args=(url, HOSTILE_KEY, MODEL, ns.per_kind, attack_s, done, queue),
                            daemon=True)
        child.start()
        time.sleep(ns.warm_s)
        t0 = time.perf_counter()
        attacked = asyncio.run(honest(url, ns.sessions, ns.turns, ns.tool_s))
        honest_s = time.perf_counter() - t0
        done.set()
        print(f"honest under attack: {len(attacked)} turns in {honest_s:.0f} s, p99 {p99(attacked):.2f} s")
        seen = queue.get(timeout=attack_s + 180)
        child.join(30)
        after = replicas()
        limits = ceilings(args)
        rows = []
        for aid, (pid, deployment) in before.items():
            alive = aid in after and after[aid][0] == pid
            peak = rss(pid) if alive else 0
            grew = peak - idle.get(aid, 0)
            rows.append({"replica": deployment, "pid": pid, "restarted": not alive, "idle_rss_mib": idle[aid] // MiB,
                         "peak_rss_mib": peak // MiB, "grew_mib": grew // MiB,
                         "ceiling_grow_mib": limits.get(deployment, 0) // MiB,
                         "under_ceiling": alive and grew <= limits.get(deployment, 0)})
        result = {"hostile_key": "unlimited" if ns.unlimited else "default limits", "honest_p99_alone_s": round(p99(alone), 3), "honest_p99_attacked_s": round(p99(attacked), 3),
                  "ratio": round(p99(attacked) / max(1e-9, p99(alone)), 2), "honest_turns": len(attacked),
                  "replicas": rows, "restarts": sum(r["restarted"] for r in rows) + max(0, len(after) - len(before)),
                  "hostile": seen}
        (out / "adversarial.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        ok = result["ratio"] <= 3 and result["restarts"] == 0 and all(r["under_ceiling"] for r in rows)
        print("\ntargets:", "met" if ok else "NOT met")
        return 0
    finally:
        local.stop_local_serve()


if __name__ == "__main__":
    raise SystemExit(main())
