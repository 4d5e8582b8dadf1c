"""`loopserve bench <name>`: one subcommand per benchmark, as `vllm bench serve|latency|...`.

    loopserve bench                      # the agent loop (`loop`), as before
    loopserve bench loop --turns 50 --rounds 3 --modes websocket
    loopserve bench vllm-compare --turns 50 --rounds 3
    loopserve bench --help               # the list

Each benchmark is one module of `cluster.bench` with a `main(argv)`; `python -m cluster.bench.X`
runs the same. docs/benchmarks.md says what each measures and its latest numbers.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

# name -> (module, what it measures)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "loop": ("cluster.bench.runner", "the agent loop over HTTP stateless, HTTP chained and WebSocket, beside an "
                                     "echo floor (scripted engine at GPU-like speed, or --url)"),
    "variants": ("cluster.bench.variants", "configurations of one app side by side, alternating rounds"),
    "targets": ("cluster.bench.targets", "the hot-path targets in one command"),
    "vllm-compare": ("cluster.bench.vllm_compare", "the real engine: loopserve against AsyncLLM alone and vLLM's "
                                                   "own server, with vLLM's core marks per turn"),
    "sessions": ("cluster.bench.sessions", "N agent sessions at once on one engine: hit, prefill, queue wait, "
                                           "completion time, against vLLM's server"),
    "load": ("cluster.bench.load", "1,000 WebSocket sessions: nothing lost, latency, CPU a turn per process"),
    "adversarial": ("cluster.bench.adversarial", "hostile clients beside honest sessions: latency and memory"),
    "turn-timings": ("cluster.bench.turn_timings", "a tool loop's per-turn server timings, inside vLLM too"),
    "profile-ws": ("cluster.bench.profile_ws", "py-spy on every replica while the WebSocket loop runs"),
    "tracing-cost": ("cluster.bench.tracing_cost", "a turn's cost with telemetry on against off"),
    "safety-loop": ("cluster.bench.safety_loop", "the safety checks' cost a turn, and a slow post-work hook's"),
    "store-latency": ("cluster.bench.store_latency", "what store: true costs a turn"),
    "family-renders": ("cluster.bench.family_renders", "each model family's 30-turn tool loop: incremental turns "
                                                       "and render CPU a turn, against every turn in full"),
    "engine-model": ("cluster.bench.engine_model", "the scripted engine's `cpu` engine model against this machine's "
                                                   "vLLM: prefill by context, decode step by batch and context"),
    "mcp-loop": ("cluster.bench.mcp_loop", "an N-step tool loop run by the client (function tools) against run "
                                           "by the server (remote MCP tools): completion, prefill, TTFT"),
    "kv-grid": ("cluster.bench.kv_grid", "the KV policy on against off at each engine model (cpu, h100-8b, "
                                         "h100-8b-long) over every transport, rounds alternating, medians"),
}
DEFAULT = "loop"


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:{width}s}  {what}" for name, (_, what) in BENCHMARKS.items()]
    return ("usage: loopserve bench [NAME] [ARGS...]   (`loopserve bench NAME --help` for its options)\n\n"
            "benchmarks:\n" + "\n".join(lines) + f"\n\nWithout a name, or with options first: `{DEFAULT}`.")


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if args and not args[0].startswith("-"):
        name, rest = args[0], args[1:]
        if name not in BENCHMARKS:
            print(f"loopserve bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
            return 2
    else:
        name, rest = DEFAULT, args
    module = importlib.import_module(BENCHMARKS[name][0])
    return int(module.main(rest) or 0)
