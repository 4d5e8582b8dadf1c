"""Profile the WebSocket agent loop: py-spy on every Serve replica while the loop runs.

    python -m cluster.bench.profile_ws --backend vllm --turns 50      # real engine (tiny model, CPU)
    python -m cluster.bench.profile_ws --backend scripted --turns 50  # the scripted engine

Prints, per process (proxy, connection, render, safety, engine), the CPU share
and the hottest functions (py-spy's own samples, `--idle` off), plus the
server's own per-turn split (engine time vs the rest) next to the client's
wall time. Collapsed stacks are saved for flame graphs (`bench_out/profile/`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import time
from pathlib import Path

import psutil

from cluster.bench.local import add_ingress_argument

ROLES = {"ConnectionActor": "connection", "RenderActor": "render", "SafetyActor": "safety",
         "EngineReplica": "engine", "ProxyActor": "proxy"}


def serve_pids() -> dict[str, int]:
    pids = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        for marker, role in ROLES.items():
            if marker in cmd and "ray::" in cmd:
                pids.setdefault(role, p.pid)
    return pids


def _all_cpu() -> dict[tuple[int, str], float]:
    out = {}
    for p in psutil.process_iter(["cmdline", "cpu_times", "nice"]):
        t = p.info["cpu_times"]
        if t is not None:
            out[(p.pid, f"nice={p.info['nice']} " + " ".join(p.info["cmdline"] or [])[:90])] = t.user + t.system
    return out


def top_functions(collapsed: Path, n: int = 12) -> tuple[int, list[tuple[str, int]]]:
    """Self time per function from py-spy's collapsed stacks ("a;b;c count")."""
    self_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        c = int(count)
        total += c
        frames = stack.split(";")
        # leaf frame, skipping the thread-name pseudo frame py-spy adds first
        self_counts[frames[-1]] += c
    return total, self_counts.most_common(n)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="loopserve bench profile-ws", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["vllm", "scripted"], default="vllm")
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--out", default="bench_out/profile")
    add_ingress_argument(ap)
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)

    from cluster.bench.agent_loop import Loop, attach_server_timings
    from cluster.bench.runner import _local_cluster
    from cluster.bench.vllm_compare import BLOCK, MAX_LEN, ws_chain

    if ns.backend == "vllm":
        args = {"engine": {"backend": "vllm", "vllm": {"block_size": BLOCK, "default_max_tokens": 8}},
                "model": {"max_model_len": MAX_LEN["loopserve-tiny"]}, "store": {"backend": "none"}, "safety": {"enabled": False}}
    else:
        from cluster.bench.runner import SCRIPTED

        args = {"engine": {"backend": "scripted", "scripted": SCRIPTED}, "store": {"backend": "none"},
                "model": {"max_model_len": 262144}}  # as `loopserve bench`: 50 turns of 2 KB outgrow 32k
    url = _local_cluster(args, ns.ingress)
    try:
        pids = serve_pids()
        print("processes:", pids)
        spies = {role: subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(ns.rate), "--format", "raw",
                                         "--nonblocking", "-o", str(out / f"{role}.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for role, pid in pids.items()}
        time.sleep(1.0)
        cpu0 = {r: psutil.Process(p).cpu_times() for r, p in pids.items()}
        every0 = _all_cpu()
        t0 = time.perf_counter()
        if ns.backend == "vllm":
            walls = asyncio.run(ws_chain(url, ns.turns, 800, 8, "loopserve-tiny"))
            turns = None
        else:
            turns = asyncio.run(Loop(url, "websocket", ns.turns, 2000).run())
            attach_server_timings(url, turns)
            walls = [t.wall_s for t in turns]
        elapsed = time.perf_counter() - t0
        cpu1 = {r: psutil.Process(p).cpu_times() for r, p in pids.items()}
        every1 = _all_cpu()
        for p in spies.values():
            p.send_signal(2)  # SIGINT: py-spy writes its output and exits
        for p in spies.values():
            p.wait(timeout=60)
        from cluster.bench.local import stats as server_stats

        stats = server_stats(url, last=1024)["turns"][-ns.turns:]
    finally:
        from cluster.bench.local import stop_local_serve

        stop_local_serve()

    engine = sum(t["engine"] for t in stats)
    server = sum(t["total"] for t in stats)
    inner = sum(t.get("engine_inner", 0.0) for t in stats)
    print(f"\n{ns.backend}: {ns.turns} turns, client wall {sum(walls):.2f} s, server turn time {server:.2f} s, "
          f"engine (as the connection actor sees it) {engine:.2f} s, server minus engine {server - engine:.2f} s, "
          f"client minus server {sum(walls) - server:.2f} s; inside the engine replica {inner:.2f} s "
          f"(handle hop + stream: {engine - inner:.2f} s, {1000 * (engine - inner) / ns.turns:.1f} ms/turn)")
    report = {"backend": ns.backend, "turns": ns.turns, "wall_s": sum(walls), "server_s": server, "engine_s": engine, "engine_inner_s": inner,
              "processes": {}}
    print("\nbusiest processes over the loop (CPU s):")
    busiest = sorted(((every1[k] - every0.get(k, 0.0), k) for k in every1), reverse=True)[:8]
    for used, (pid, name) in busiest:
        print(f"   {used:6.2f}  {pid:>7} {name[:100]}")
    report["busiest"] = [[used, pid, name] for used, (pid, name) in busiest]
    for role in pids:
        busy = (cpu1[role].user + cpu1[role].system) - (cpu0[role].user + cpu0[role].system)
        path = out / f"{role}.txt"
        total, top = top_functions(path) if path.exists() else (0, [])
        report["processes"][role] = {"cpu_s": busy, "cpu_share": busy / elapsed, "samples": total,
                                     "top_self": top}
        print(f"\n[{role}] CPU {busy:.2f} s over {elapsed:.1f} s ({100 * busy / elapsed:.0f}% of one core)")
        for fn, c in top[:8]:
            print(f"   {100 * c / max(total, 1):5.1f}%  {fn[:140]}")
    (out / f"report_{ns.backend}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
