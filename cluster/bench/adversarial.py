"""Hostile clients beside honest agent sessions, through HAProxy: `python -m cluster.bench.adversarial`.

What the replica's bounds are judged by: 96 hostile clients (16 of
each kind in `hostile.py`: decompression-bomb images, queued creates of many small items, large and
complex bodies, long stored chains read back and /health floods, 64 KiB ignored frames at line rate,
slow readers of a flagged answer) beside 8 honest agent sessions over
WebSocket, on the scripted engine with a vision model's renderer (the built-in tiny Idefics3), a
SQLite store and API keys. One run, two phases: the honest sessions alone, then with the hostile
clients. Reported: the honest sessions' p99 turn in each phase and their ratio (target <= 3), every
replica's peak RSS against its ceiling, replica restarts (target 0), what the hostile clients
were answered, and flagged characters a slow reader was sent (target <= max_unverified).

    python -m cluster.bench.adversarial --out bench_out/adversarial
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from cluster.bench.hostile import FLAG_TRIGGER, KINDS, run_hostile
from cluster.bench.processes import CpuMeter, replicas, rss
from cluster.models.names import TINY_VISION

HONEST_KEY, HOSTILE_KEY = "sk-adversarial-honest", "sk-adversarial-hostile"
MODEL = TINY_VISION
MiB = 1024 * 1024
TRACE = "connection.trace.json"


def app_args(store_path: str, hostile_limited: bool) -> dict[str, Any]:
    from cluster.auth import key_sha256

    # Limited: the hostile key has the defaults (600 creates, 3,000 reads a minute, 64 MiB of creates
    # and 256 MiB of reads a minute), the designed
    # defence of the replicas' CPU. Unlimited: a tenant whose plan allows a lot, so what reaches
    # the server is what the bounds below the rate limits must hold.
    hostile = {} if hostile_limited else {"max_connections": 10_000, "requests_per_minute": 1_000_000,
                                          "reads_per_minute": 1_000_000, "input_bytes_per_minute": 1 << 50,
                                          "read_bytes_per_minute": 1 << 50}

    return {
        "model": {"name": MODEL, "builtin": MODEL, "max_model_len": 32768,
                  "images": {"max_per_context": 8, "max_image_bytes": 8 * MiB}},
        "engine": {"backend": "scripted", "scripted": {
            "tokens_per_second": 400, "prefill_tokens_per_second": 20000,
            "max_output_tokens": 2048,  # the `queued` clients' long answers, the `flagged` ones' 8,000 characters
            # the `flagged` hostile client's answer: a secret the safety policy flags, then 8,000 characters
            "answer_rules": [{"contains": FLAG_TRIGGER, "text": "-----BEGIN RSA PRIVATE KEY----- " + "x" * 8000}]}},
        "safety": {"policy": {"secrets": ["BEGIN RSA PRIVATE KEY"]}},
        "store": {"backend": "sqlite", "sqlite_path": store_path},
        "auth": {"keys": [{"sha256": key_sha256(HONEST_KEY), "tenant": "honest"},
                          {"sha256": key_sha256(HOSTILE_KEY), "tenant": "hostile", **hostile}]},
        # The loop watch keeps the stack of every stall over 0.25 s (1 s by default): where the tail goes.
        "connection": {"ray_actor_options": {"num_cpus": 0.25, "runtime_env": {"env_vars": {"LOOPSERVE_LOOP_STALL_S": "0.25"}}},
                       "max_ongoing_requests": 400},
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


async def honest(base: str, sessions: int, turns: int, tool_s: float, slow: Optional[list] = None) -> list[float]:
    """The honest sessions' turn times; turns over a second go to `slow` with the server's split."""
    from cluster.bench.agent_loop import Loop

    loops = [Loop(base, "websocket", turns, 600, tool_delay_s=tool_s, model=MODEL, api_key=HONEST_KEY)
             for _ in range(sessions)]
    results = await asyncio.gather(*(loop.run() for loop in loops))
    if slow is not None:
        slow.extend({"session": i, "turn": t.turn, "wall_s": round(t.wall_s, 3), "first_event_s": round(t.first_event_s, 3),
                     "split_s": {k: round(v, 3) for k, v in t.split().items()}}
                    for i, turns_ in enumerate(results) for t in turns_ if t.wall_s > 1.0)
    return [t.wall_s for turns_ in results for t in turns_]


def cpu_quota(pid: int, cpus: float) -> None:
    """Hold a process to `cpus` CPUs with a cgroup's CFS quota (v2, else v1's cpu controller)."""
    period = 100_000
    v2, v1 = Path("/sys/fs/cgroup/loopserve-hostile"), Path("/sys/fs/cgroup/cpu/loopserve-hostile")
    try:
        if Path("/sys/fs/cgroup/cgroup.controllers").exists():
            v2.mkdir(exist_ok=True)
            (v2 / "cpu.max").write_text(f"{int(cpus * period)} {period}")
            (v2 / "cgroup.procs").write_text(str(pid))
        else:
            v1.mkdir(exist_ok=True)
            (v1 / "cpu.cfs_period_us").write_text(str(period))
            (v1 / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            (v1 / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        raise SystemExit(f"--hostile-cpu needs a writable cgroup cpu controller (root): {exc}") from exc


def profile(out: Path, live: dict[str, tuple[int, str]]) -> subprocess.Popen:
    """py-spy recording the connection replica until interrupted, as a timeline (chrometrace, idle
    samples included): `loop_trace.busy_runs` names what kept its event loop busy longest."""
    pid = next(pid for pid, deployment in live.values() if deployment == "ConnectionActor")
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--format", "chrometrace", "--rate", "100",
                             "--idle", "--threads", "--output", str(out / TRACE)], stdout=subprocess.DEVNULL)


def shapes() -> dict[str, float]:
    """What reading a body costs a replica's event loop, ms a MiB, for the worst JSON shapes within
    the request bounds (the calibration of `input_bytes_per_minute`): the bounds read from the text,
    json.loads, and for creates the request's validation. Best of 3 on this machine."""
    from cluster.protocol.request_bounds import MAX_JSON_CONTAINERS, json_bounds
    from cluster.protocol.requests import parse_request

    n = MAX_JSON_CONTAINERS - 1
    bodies = {
        "[[],[],...] (to the container bound)": ("[" + "[]," * n + "[]]", False),
        "[1,1,...]": ("[" + "1," * (MiB // 2) + "1]", False),
        '{"0":1,...}': ("{" + ",".join(f'"{i}":1' for i in range(MiB // 9)) + "}", False),
        "10,000 one-part messages": (json.dumps({"model": "m", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}]}] * 10_000}), True),
        "10,000 one-character messages": (json.dumps({"model": "m", "input": [{"role": "user", "content": "a"}] * 10_000}), True),
    }
    out = {}
    for name, (text, create) in bodies.items():
        raw, best = text.encode(), float("inf")
        for _ in range(3):
            started = time.perf_counter()
            json_bounds(raw)
            value = json.loads(raw)
            if create:
                parse_request(value, max_input_items=10_000)
            best = min(best, time.perf_counter() - started)
        out[name] = round(best * 1000 / (len(raw) / MiB), 1)
    return out


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="loopserve bench adversarial", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8, help="honest agent sessions")
    ap.add_argument("--turns", type=int, default=20, help="turns of each honest session")
    ap.add_argument("--tool-s", type=float, default=2.0, help="an honest session's tool time between turns")
    ap.add_argument("--per-kind", type=int, default=16, help="hostile clients of each kind")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"which kinds of hostile client run (of {','.join(KINDS)})")
    ap.add_argument("--hostile-cpu", type=float, default=0.0,
                    help="hold the hostile process to this many CPUs (a cgroup quota; needs root): an attacker "
                         "elsewhere on the network costs the server nothing of its own CPU, one on a 2-core "
                         "test machine does")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy the connection replica through the attacked phase (a timeline in --out; "
                         "its longest busy runs in the report)")
    ap.add_argument("--warm-s", type=float, default=10.0, help="hostile clients start this long before the honest ones")
    ap.add_argument("--unlimited", action="store_true",
                    help="the hostile key without rate limits (memory and restarts; CPU is then shared freely)")
    ap.add_argument("--out", default="bench_out/adversarial")
    ap.add_argument("--shapes", action="store_true",
                    help="only print what reading the worst JSON shapes costs, ms a MiB (no server)")
    ns = ap.parse_args(argv)
    if ns.shapes:
        print(json.dumps(shapes(), indent=1))
        return 0
    kinds = [k for k in ns.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds takes some of {','.join(KINDS)}")

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
        clients = {os.getpid(): "honest client"}
        meter = CpuMeter(lambda: clients)
        meter.start()
        alone = asyncio.run(honest(url, ns.sessions, ns.turns, ns.tool_s))
        cpu_alone = meter.stop()
        print(f"honest alone: {len(alone)} turns, p99 {p99(alone):.2f} s, CPU s {cpu_alone}")
        ctx = multiprocessing.get_context("spawn")
        queue: Any = ctx.Queue()
        done = ctx.Event()
        attack_s = ns.warm_s + 3 * (max(alone) + ns.tool_s) * ns.turns + 60  # outlasts the honest run under attack
        child = ctx.Process(target=run_hostile, daemon=True,
                            args=(url, HOSTILE_KEY, MODEL, {k: ns.per_kind for k in kinds}, attack_s, done, queue))
        child.start()
        clients[child.pid] = "hostile clients"
        if ns.hostile_cpu:
            cpu_quota(child.pid, ns.hostile_cpu)
        time.sleep(ns.warm_s)
        spy = profile(out, before) if ns.profile else None
        loop_before = local.stats(url)["loop"]
        meter.start()
        t0 = time.perf_counter()
        slow: list[dict[str, Any]] = []
        attacked = asyncio.run(honest(url, ns.sessions, ns.turns, ns.tool_s, slow))
        honest_s = time.perf_counter() - t0
        cpu_attacked = meter.stop()
        loop_after = local.stats(url)["loop"]
        done.set()
        if spy:
            spy.send_signal(2)  # py-spy writes its file on SIGINT
            spy.wait(60)
        print(f"honest under attack: {len(attacked)} turns in {honest_s:.0f} s, p99 {p99(attacked):.2f} s, CPU s {cpu_attacked}")
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
        result = {"hostile_key": "unlimited" if ns.unlimited else "default limits", "kinds": kinds,
                  "hostile_cpu": ns.hostile_cpu or "unbounded",
                  "honest_p99_alone_s": round(p99(alone), 3), "honest_p99_attacked_s": round(p99(attacked), 3),
                  "ratio": round(p99(attacked) / max(1e-9, p99(alone)), 2), "honest_turns": len(attacked),
                  "honest_p50_alone_s": round(sorted(alone)[len(alone) // 2], 3),
                  "honest_p50_attacked_s": round(sorted(attacked)[len(attacked) // 2], 3),
                  "cpu_s_alone": cpu_alone, "cpu_s_attacked": cpu_attacked, "attacked_phase_s": round(honest_s, 1),
                  "slow_turns_attacked": slow,
                  "connection_loop_attacked": {k: (round(v - loop_before[k], 3) if isinstance(v, (int, float))
                                                   and not k.endswith("max_s") else v)
                                               for k, v in loop_after.items()},
                  "replicas": rows, "restarts": sum(r["restarted"] for r in rows) + max(0, len(after) - len(before)),
                  "hostile": seen}
        if spy:
            from cluster.bench.loop_trace import busy_runs

            result["connection_busy_runs"] = busy_runs(out / TRACE, top=4)
        (out / "adversarial.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        leaked = seen.get("flagged", {}).get("flagged released over max_unverified", 0)
        ok = result["ratio"] <= 3 and result["restarts"] == 0 and all(r["under_ceiling"] for r in rows) and not leaked
        print("\ntargets:", "met" if ok else "NOT met")
        return 0
    finally:
        local.stop_local_serve()


if __name__ == "__main__":
    raise SystemExit(main())
