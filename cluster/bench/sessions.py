"""Many agent sessions at once: hit, prefill, preemptions, queue wait and latency against N.

    python -m cluster.bench.sessions                       # N = 1, 8, 16 on serve_configs/local.yaml,
                                                           # beside vLLM's server and agentic-api
    python -m cluster.bench.sessions --sessions 8 --systems loopserve,vllm
    python -m cluster.bench.sessions --engine scripted --sessions 1000 --replicas 4 --oversubscribe 2
    python -m cluster.bench.sessions --preset agentx       # the shape of published agent traces, scaled

Each session opens with a message, then sends `--turns` turns; each turn adds a tool
result of `--turn-chars` characters (unique text per session and run) after a pause
drawn from `--pause` (the client running its tool) and asks for `--output-tokens`.
Per run it reports, from the client's side of every system:
- hit = cached_tokens / (previous turn's input + output tokens), overall and for late
  turns (the second half);
- tokens prefilled (input - cached) against tokens necessary (input - previous input
  and output);
- preemptions (the engine's own counter) and queue wait (the server's: loopserve's
  KV budget, vLLM's request queue time);
- turn latency mean/p50/p99 (the client's clock, send to terminal event) and the time
  until every session is done.
Systems: `loopserve` (WebSocket mode, `store: false`, the config as shipped),
`vllm` (vLLM's own server, `/v1/responses` chained with previous_response_id),
`agentic` (vLLM's agentic-api gateway over WebSocket, in front of that server), all on
the same model, KV size and CPU threads, one after the other in one run (`--rounds R`: R
times, interleaved, each on fresh servers; medians reported). With
`--engine scripted` the engine is the scripted stand-in with its modelled KV cache
(engines/scripted/kv_model.py), and the comparison is loopserve with its KV budget against
loopserve without it (hash-only placement, no retention): `loopserve-nobudget`.
`vllm-beside-ray`: vLLM's server while an idle loopserve cluster (Ray, Serve and loopserve's
actors, on the scripted engine so no second vLLM) runs on the same machine: what the
resident processes of a Ray Serve cluster alone cost vLLM's server's turns.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from cluster.bench.agent_loop import progress_bar
from cluster.bench.session_clients import TRANSPORTS, SessionPlan, run_session
from cluster.bench.local import add_ingress_argument
from cluster.bench.session_systems import (
    BESIDE_RAY,
    STAND_IN,
    kill_engine_replica_after,
    loopserve,
    loopserve_args,
    loopserve_engine_stats,
    loopserve_session_moves,
)
from cluster.bench.session_report import (
    calibrate,
    calibration_table,
    median_of_rounds,
    plot_svg,
    summarize,
    table,
)


@dataclass
class Workload:
    turns: int = 10
    turn_chars: int = 2000
    output_tokens: int = 16
    pause: tuple[float, float] = (0.5, 3.0)
    # "agentx": turn sizes and pauses drawn from heavy-tailed distributions around these
    # medians (published agent traces: many turns, most small, a few large tool outputs).
    shape: str = "uniform"
    seed: int = 0
    pause_scale: float = 0.05  # "trace": published pauses x this (a 2-core machine runs ~1/20 the turns)

    def turn_size(self, rng: random.Random) -> int:
        if self.shape == "agentx":
            return int(min(4 * self.turn_chars, max(200, rng.lognormvariate(0, 0.8) * self.turn_chars)))
        return self.turn_chars

    def pause_s(self, rng: random.Random) -> float:
        lo, hi = self.pause
        if self.shape == "trace":
            return trace_pause(rng, self.pause_scale)
        if self.shape == "agentx":
            return min(4 * hi, max(lo, rng.lognormvariate(0, 0.7) * (lo + hi) / 2))
        return rng.uniform(lo, hi)


PRESETS = {"agentx": Workload(turns=20, turn_chars=1200, output_tokens=24, pause=(0.5, 3.0), shape="agentx"),
           "trace": Workload(turns=10, turn_chars=2000, output_tokens=16, pause=(0.0, 0.0), shape="trace")}

# Published agent traces (TraceLab, arXiv 2606.30560): tool pauses p50 0.3 s, p90 13.6 s; one pause
# in ten a human's, p50 84 s, p90 1,236 s. Lognormal: sigma = ln(p90 / p50) / 1.2816.
TRACE_TOOL = (0.3, 13.6)
TRACE_HUMAN = (84.0, 1236.0)
TRACE_HUMAN_SHARE = 0.1


def trace_pause(rng: random.Random, scale: float) -> float:
    p50, p90 = TRACE_HUMAN if rng.random() < TRACE_HUMAN_SHARE else TRACE_TOOL
    sigma = math.log(p90 / p50) / 1.2816
    return min(60.0, scale * p50 * math.exp(rng.gauss(0.0, sigma)))


_WORDS = ("the test", "failed", "because", "the value", "was not", "expected", "in module", "when the", "function",
          "returned", "an error", "for input", "see line", "of the file", "and then", "passed", "after", "retry")


def tool_output(session: str, turn: int, chars: int) -> str:
    """A tool result of `chars` characters, unique to the session and turn: English-like words
    (~4 characters a token, like the issue's workload) after a header naming both."""
    rng = random.Random(f"{session}:{turn}")
    parts = [f"[{session}] $ pytest tests/test_mod_{turn}.py -q\n"]
    size = len(parts[0])
    while size < chars:
        part = f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {rng.choice(_WORDS)}. "
        parts.append(part)
        size += len(part)
    return "".join(parts)[:chars]


def session_tag(w: Workload, n: int, index: int, variant: int = 0) -> str:
    """The same text for session `index` of an N-session run on every system: greedy outputs
    (and so the decode work each turn asks for) are then the same side by side. Unique across
    N values and across the transports one server runs one after the other (`variant`), so a
    server holds no prefix of a session it has not seen."""
    return hashlib.sha256(f"{w.seed}:{w.shape}:{n}:{index}:{variant}".encode()).hexdigest()[:12]


@dataclass
class Row:
    system: str
    sessions: int
    session: int
    turn: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    latency_s: float
    queued_s: Optional[float]  # None: the transport shows no wait (a plain POST has no response.queued)
    status: str
    sent_at: float = 0.0  # the client's clock (perf_counter) when the turn was sent


def _row(system: str, n: int, index: int, turn: int, ev: dict, latency: float, queued: Optional[float], sent_at: float) -> Row:
    if ev.get("type") == "error" or "response" not in ev:
        print(f"\n{system}: session {index} turn {turn} failed: {str(ev)[:300]}", file=sys.stderr)
        return Row(system, n, index, turn, 0, 0, 0, latency, queued, "error", sent_at)
    resp = ev["response"]
    usage = resp.get("usage") or {}
    cached = ((usage.get("input_tokens_details") or {}).get("cached_tokens")) or 0
    return Row(system, n, index, turn, usage.get("input_tokens") or 0, cached, usage.get("output_tokens") or 0,
               latency, queued, resp.get("status", "?"), sent_at)


async def run_sessions(system: str, url: str, model: str, n: int, w: Workload, transport: str,
                       store: bool = False, shape: str = "plain", ttl: Optional[str] = None,
                       variant: int = 0) -> tuple[list[Row], float]:
    """N sessions at once over `transport` (session_clients.TRANSPORTS; "websocket" is "ws")."""
    total, done = n * (w.turns + 1), 0
    rows: list[Row] = []
    transport = "ws" if transport == "websocket" else transport

    async def one(index: int) -> None:
        nonlocal done
        tag = session_tag(w, n, index, variant)
        plan = SessionPlan(system, url, model, index, n, transport, store, shape, ttl)

        def text(turn: int, rng: random.Random) -> str:
            return f"Session {tag}: start the task." if not turn else tool_output(tag, turn, w.turn_size(rng))

        def record(turn: int, ev: dict, latency: float, queued: Optional[float], sent_at: float) -> None:
            nonlocal done
            rows.append(_row(f"{system}", n, index, turn, ev, latency, queued, sent_at))
            done += 1
            progress_bar(f"{system} N={n} {transport}", done, total)

        await run_session(plan, w, text, record)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(n)])
    return rows, time.perf_counter() - t0


# Before a system is measured: one short session through it (the engine's first passes of each
# shape, connection set-up, allocators) and a pause for what a freshly started server still does in
# the background (Ray's agents and log monitor after a cluster start, a peer's first metrics
# scrapes). Every system gets the same: the run measures serving, not start-up.
WARM_UP = Workload(turns=2, turn_chars=400, output_tokens=8, pause=(0.0, 0.0), seed=10_000)
SETTLE_S = 5.0


def warm_up(system: str, url: str, model: str, transport: str, store: bool) -> None:
    asyncio.run(run_sessions(f"{system} warm-up", url, model, 1, WARM_UP, transport, store=store))
    time.sleep(SETTLE_S)


def _exit_once(*_: Any) -> None:
    # A second SIGTERM (`timeout` forwards its own, a process-group kill repeats it) must not
    # interrupt the cleanup the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="loopserve bench sessions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,8,16", help="comma-separated N values")
    ap.add_argument("--systems", default=None, help="loopserve,vllm,agentic (real; add stand-in to calibrate the scripted engine's "
                         "modelled KV against vLLM in the same run; vllm-beside-ray: vLLM's server beside an idle "
                         "cluster) | loopserve,loopserve-nobudget (scripted)")
    ap.add_argument("--engine", choices=["vllm", "scripted"], default="vllm")
    ap.add_argument("--config", default="serve_configs/local.yaml")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="agentx: heavy-tailed turns; trace: tool pauses and "
                    "human waits shaped as published agent traces, x --pause-scale")
    ap.add_argument("--pause-scale", type=float, default=0.05)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-chars", type=int, default=2000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--pause", default="0.5,3", help="min,max seconds between turns")
    ap.add_argument("--replicas", type=int, default=1, help="engine replicas (loopserve)")
    ap.add_argument("--connections", type=int, default=1, help="connection replicas (loopserve)")
    ap.add_argument("--transports", default="ws", help=f"loopserve's clients, comma-separated: {', '.join(TRANSPORTS)} "
                    "(each on the same server, one after the other; the peers keep theirs)")
    ap.add_argument("--shape", choices=["plain", "agent"], default="plain",
                    help="agent: a function is offered and each turn answers the model's last call")
    ap.add_argument("--ttl", choices=["30m", "12h"], default=None, help="send prompt_cache_options.ttl")
    ap.add_argument("--prefill-unit", choices=["serial", "parallel"], default="serial",
                    help="scripted engine: prefills share one compute unit (a CPU) or run side by side (a GPU's batch)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="scripted engine: modelled KV per replica")
    ap.add_argument("--lower-tier", type=float, default=0.0,
                    help="scripted engine: a modelled KV tier below each replica's, this many times its KV")
    ap.add_argument("--kill-engine-at", type=float, default=None,
                    help="loopserve: kill one engine replica this many seconds into each run (sessions re-placed)")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="real engine: KV blocks of every system's engine (vLLM's num_gpu_blocks_override), to scale "
                         "the workload's KV pressure to a slower machine with shorter turns")
    ap.add_argument("--oversubscribe", type=float, default=None,
                    help="scripted engine: size the KV so the sessions' final histories are this x the total")
    ap.add_argument("--rates", default="1500,60", help="scripted engine: prefill,decode tokens/s (this CPU's vLLM)")
    ap.add_argument("--engine-model", choices=["cpu", "h100-8b", "h100-8b-long"], default=None,
                    help="scripted engine: a real engine's step times (engine.scripted.preset) instead of --rates")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, interleaved (A B C A B C ...), each on a fresh server; "
                         "report the median of each figure (this machine drifts ~10%% between runs)")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--targets", action="store_true",
                    help="the cache targets from one run (cluster/bench/session_targets.py): every transport on the "
                         "scripted engine at 6x with and without the KV policy, the real engine at N=8,16 over ws and "
                         "http beside vLLM's server (KV: --kv-blocks, default 46,592 tokens), 1,000 trace-paced "
                         "sessions over 4 replicas with a lower tier and one replica killed")
    add_ingress_argument(ap)
    ns = ap.parse_args(argv)
    # A stopped benchmark (SIGTERM) still stops what it started: the peers run in sessions of
    # their own and would otherwise keep their ports and memory.
    signal.signal(signal.SIGTERM, _exit_once)
    if ns.targets:
        from cluster.bench.session_targets import run_targets

        return run_targets(ns, run)
    run(ns)
    return 0


# The KV budget's counters (engine `stats`, kv) a run reports as deltas; `kv_recent_ends`: why retentions went.
KV_COUNTS = ("retained", "returned_in_time", "expired", "released", "evicted", "evicted_soft", "evicted_lapsed",
             "reprefills", "over_wave")


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """One run of the systems in `ns` at each N; prints the tables, writes `sessions.json` and
    the plot under `ns.out`, returns what it wrote."""
    w = PRESETS[ns.preset] if ns.preset else Workload(ns.turns, ns.turn_chars, ns.output_tokens,
                                                     tuple(float(x) for x in ns.pause.split(",")))
    w = replace(w, pause_scale=ns.pause_scale)
    transports = ns.transports.split(",")
    ns_values = [int(x) for x in ns.sessions.split(",")]
    systems = (ns.systems or ("loopserve,vllm,agentic" if ns.engine == "vllm" else "loopserve,loopserve-nobudget")
               ).split(",")
    kv_tokens = ns.kv_tokens
    if ns.engine == "scripted" and ns.oversubscribe:
        # one session at its end (~4.5 chars a token; the agent shape's tool schema and calls on top)
        final = 60 + w.turns * (w.turn_chars / 4.5 + w.output_tokens + 12) + (250 if ns.shape == "agent" else 0)
        kv_tokens = int(max(ns_values) * final / ns.oversubscribe / ns.replicas)
    rates = tuple(float(x) for x in ns.rates.split(","))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    per_round: list[dict[str, Any]] = []  # one entry per system, N and round
    all_rows: list[Row] = []

    def record(system: str, n: int, rows: list[Row], elapsed: float, server: dict[str, Any]) -> None:
        all_rows.extend(rows)
        per_round.append({"system": system, "sessions": n, **summarize(rows, w.turns, elapsed), **server})
        print("\n" + table(per_round[-1:]), flush=True)

    real_kv_tokens: Optional[int] = None  # the real engine's capacity, seen by loopserve's run

    def run_system(system: str, w_round: Workload, rnd: int) -> None:
        nonlocal real_kv_tokens
        with ExitStack() as stack:
            if system.startswith("loopserve") or system == STAND_IN:
                engine = "scripted" if system == STAND_IN else ns.engine
                sys_kv = kv_tokens
                if system == STAND_IN and ns.engine == "vllm":
                    # The stand-in at the real engine's KV size: its hit curve is the calibration.
                    sys_kv = ns.kv_tokens or real_kv_tokens or (ns.kv_blocks or 0) * 32 or 46_592
                args = loopserve_args(ns.config, engine, ns.replicas, sys_kv, system == "loopserve", rates,
                                      ns.kv_blocks, max(ns_values), connections=ns.connections,
                                      store_dir=str(out) if transports != ["ws"] else None,
                                      serial_prefill=ns.prefill_unit == "serial", lower_tier=ns.lower_tier,
                                      engine_model=ns.engine_model)
                url = stack.enter_context(loopserve(args, ns.ingress))
                model = args["model"]["name"]
                warm_up(system, url, model, "websocket", store=False)
                for n, transport in [(n, t) for n in ns_values for t in transports]:
                    before, moves = loopserve_engine_stats(url), loopserve_session_moves(url)
                    kill = kill_engine_replica_after(ns.kill_engine_at) if ns.kill_engine_at else None
                    rows, elapsed = asyncio.run(run_sessions(f"{system}/{transport}", url, model, n, w_round, transport,
                                                             shape=ns.shape, ttl=ns.ttl,
                                                             variant=transports.index(transport)))
                    after, moves = loopserve_engine_stats(url), loopserve_session_moves(url) - moves
                    pre = sum(s.get("preemptions", 0) for s in after) - sum(s.get("preemptions", 0) for s in before)
                    wait = max((s.get("max_queue_wait_s", 0.0) for s in after), default=0.0)
                    capacity = max((s.get("capacity_tokens", 0) for s in after), default=0) or sys_kv
                    if engine == "vllm" and capacity:
                        real_kv_tokens = capacity
                    kv_counts = {k: sum(s.get(k, 0) for s in after) - sum(s.get(k, 0) for s in before)
                                 for k in KV_COUNTS}  # what the KV budget did in this run
                    record(f"{system}/{transport}", n, rows, elapsed, {"round": rnd, "preemptions": pre,
                                                      "server_max_queue_wait_s": wait, "kv_counts": kv_counts,
                                                      "kv_recent_ends": [e for s in after for e in s.get("recent_ends", [])],
                                                      "engine_replicas": len(after), "kv_tokens": capacity,
                                                      "session_moves": moves,
                                                      "killed_replica": getattr(kill, "killed", None)})
            else:
                from cluster.bench.peers import agentic_api, vllm_metrics, vllm_server
                from cluster.engines.vllm.engine import _on_cpu, resolve_dtype, resolve_enforce_eager
                from cluster.models.builtin import ensure_builtin

                if system == BESIDE_RAY:  # an idle cluster, up before vLLM's server starts
                    stack.enter_context(loopserve(loopserve_args(ns.config, "scripted", 1, None, True, rates),
                                                  ns.ingress))
                args = loopserve_args(ns.config, "vllm", 1, None, True, rates, ns.kv_blocks)
                model_cfg, vcfg = args["model"], args["engine"].get("vllm", {})
                model_dir = str(ensure_builtin(model_cfg.get("builtin", "loopserve-tiny")))
                vurl = stack.enter_context(vllm_server(
                    model_dir, served_name=model_cfg["name"], max_len=model_cfg.get("max_model_len", 8192),
                    block_size=vcfg.get("block_size") or 32, kv_gib=vcfg.get("cpu_kvcache_space_gib", 1),
                    # loopserve's engine's dtype: the same kernels and the same KV tokens side by side
                    dtype=resolve_dtype(vcfg.get("dtype", "auto"), _on_cpu()), kv_blocks=ns.kv_blocks,
                    eager=resolve_enforce_eager(vcfg.get("enforce_eager"), _on_cpu()),  # captured as loopserve's is
                    log_path=str(out / f"{system}-vllm.log")))
                url = stack.enter_context(agentic_api(vurl, str(out / "agentic.log"))) if system == "agentic" else vurl
                transport = "websocket" if system == "agentic" else "http"
                warm_up(system, url, model_cfg["name"], transport, store=True)
                for n in ns_values:
                    before = vllm_metrics(vurl)
                    rows, elapsed = asyncio.run(run_sessions(system, url, model_cfg["name"], n, w_round, transport,
                                                             store=True, shape=ns.shape))
                    after = vllm_metrics(vurl)
                    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                    qn = delta.get("vllm:request_queue_time_seconds_count", 0) or 1
                    record(system, n, rows, elapsed, {
                        "round": rnd, "preemptions": int(delta.get("vllm:num_preemptions_total", 0)),
                        "server_mean_queue_wait_s": round(delta.get("vllm:request_queue_time_seconds_sum", 0) / qn, 3)})

    rounds = max(1, ns.rounds)
    for rnd in range(rounds):
        # Every system once per round, in the same order, each on a server started afresh: the
        # machine's drift over a run falls on all of them alike; each round its own texts and pauses.
        w_round = replace(w, seed=w.seed + rnd)
        for system in systems:
            run_system(system, w_round, rnd)
    results = median_of_rounds(per_round) if rounds > 1 else per_round
    if rounds > 1:
        print("\nper round:\n" + table(per_round) + f"\n\nmedian of {rounds} rounds:")
    print("\n" + table(results))
    calibration = calibrate(results)
    if calibration:
        print("\n" + calibration_table(calibration))
    report = {"workload": asdict(w), "args": vars(ns), "results": results, "per_round": per_round,
              "calibration": calibration,
              "rows": [asdict(r) for r in all_rows]}
    (out / "sessions.json").write_text(json.dumps(report, indent=1))
    svg = plot_svg(results, out / "sessions.svg")
    print(f"\nresults: {out / 'sessions.json'}; plot: {svg}")
    return report


if __name__ == "__main__":
    sys.exit(main())
