"""Per-turn server timings of a tool loop on one WebSocket, read from the server.

    python -m cluster.bench.turn_timings --turns 20 --backend scripted --output-bytes 2000

Starts a local Ray cluster + the Serve app, runs a Codex-like loop (warm-up,
then each turn: the model calls a tool, the client sends a tool output of
`--output-bytes` plus a user message, chained with previous_response_id and
only new items), then prints the server's own timings per turn.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time

from cluster.bench.local import stats as server_stats
from cluster.core.messages import ENGINE_CORE_TIMINGS

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="loopserve bench turn-timings", description=__doc__)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--backend", choices=["scripted", "vllm"], default="scripted")
    ap.add_argument("--output-bytes", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64, help="each turn's max_output_tokens")
    ns = ap.parse_args(argv)

    from openai import OpenAI

    from cluster.bench.common import deploy, start_cluster, stop_cluster

    args = {"engine": {"backend": ns.backend}, "model": {"max_model_len": 32768}}
    if ns.backend == "vllm":
        args["engine"]["vllm"] = {"block_size": 32, "default_max_tokens": 8}
    url = deploy(start_cluster(), "timings", args)
    client = OpenAI(base_url=url + "/v1", api_key="x", timeout=120)
    unique = secrets.token_hex(8)  # no run hits the KV cache of an earlier one
    rows = []
    try:
        with client.responses.connect() as conn:
            def turn(**body):
                conn.response.create(model="loopserve-tiny", tools=TOOLS, store=False,
                                     instructions="You are a coding agent.", **body)
                for ev in conn:
                    if ev.type in ("response.completed", "response.incomplete", "response.failed", "error"):
                        return ev
            ev = turn(input=f"[{unique}] Fix the failing test.", generate=False)
            prev = ev.response
            new = []
            for i in range(ns.turns):
                sent = len(json.dumps(new))
                t0 = time.perf_counter()
                ev = turn(previous_response_id=prev.id, input=new, max_output_tokens=ns.max_tokens)
                wall = time.perf_counter() - t0
                prev = ev.response
                calls = [o for o in prev.output if o.type == "function_call"]
                new = [{"type": "function_call_output", "call_id": c.call_id,
                        "output": (f"line {i} of the file " * 200)[: ns.output_bytes]} for c in calls]
                new.append({"type": "message", "role": "user", "content": f"step {i}: read the next file"})
                rows.append((i + 1, sent, prev.usage.input_tokens, prev.usage.input_tokens_details.cached_tokens, wall))
        stats = server_stats(url)
    finally:
        stop_cluster()
    turns = [t for t in stats["turns"] if t["prompt_tokens"]][-ns.turns:]
    print(f"backend={ns.backend} turns={ns.turns} tool-output bytes={ns.output_bytes}")
    # The engine's part, split: `dispatch` from the connection's engine call to the replica starting
    # it, `inner` the replica's own time (its first token after `engine_ttft`), `back` the rest of
    # the connection's engine time (the stream's items and its end on their way back).
    # Inside vLLM (its engine core's marks; 0 on the scripted engine): to the core, queued there,
    # prefill, decode, and back to the replica.
    print("turn  bytes_sent  ctx_items  prompt_tok  cached_tok  render_ms  resolve_ms  overhead_ms  dispatch_ms  "
          "engine_ttft_ms  inner_ms  back_ms  total_ms  client_ms  full  core: in  queued  prefill  decode  out")
    for (i, sent, inp, cached, wall), t in zip(rows, turns):
        overhead = (t["total"] - t["engine"]) * 1000
        back = (t["engine"] - t["engine_inner"] - t["engine_dispatch"]) * 1000
        print(f"{i:4d}  {sent:10d}  {t['context_items']:9d}  {inp:10d}  {cached:10d}  {t['render']*1000:9.2f}  "
              f"{t['resolve']*1000:10.3f}  {overhead:11.2f}  {t['engine_dispatch']*1000:11.2f}  "
              f"{t['engine_first_token']*1000:14.1f}  {t['engine_inner']*1000:8.1f}  {back:7.2f}  "
              f"{t['total']*1000:8.1f}  {wall*1000:9.1f}  {t['full_render']!s:5}  "
              + "  ".join(f"{t[k] * 1000:6.2f}" for k in ENGINE_CORE_TIMINGS))
    print("render counters:", {k: v for k, v in stats["render"].items() if k != "probe"})


if __name__ == "__main__":
    main()
