"""The agent loop on the real engine: loopserve (vllm backend) vs the engine floor vs vLLM's server.

    python -m cluster.bench.vllm_compare --turns 50 --message-chars 800
    python -m cluster.bench.vllm_compare --model smollm2-135m-instruct --turns 20 --message-chars 600

Same model (the generated tiny one, or the real built-in SmolLM2), same loop, one engine at a
time, `--rounds` rounds (each round in the other order: this machine is shared and noisy):
- floor:     vLLM's AsyncLLM in this process, fed token ids directly (no server);
- loopserve: WebSocket mode, previous_response_id, only new items;
- peer:      vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`),
             `/v1/responses` chained with previous_response_id (VLLM_ENABLE_RESPONSES_API_STORE=1).
Each turn adds a user message of `--message-chars` (unique per run) and the
model answers `--max-tokens` tokens (temperature 0). Prefix caching everywhere.

The floor and loopserve also report where a turn's time went inside vLLM, from its engine core's
own marks (`CoreTimeline`: to the core, queued, prefill, decode, back): the model's time
(prefill + decode) beside the rest says whether a gap is the engine's work or the path to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional
from unittest import mock

from cluster.bench.local import add_ingress_argument
from cluster.core.messages import ENGINE_CORE_TIMINGS, CoreTimeline
from cluster.models.names import SMOLLM2, TINY

BLOCK = 32
MAX_LEN = {TINY: 32768, SMOLLM2: 8192}  # max_position_embeddings

def _message(turn: int, chars: int, prefix: str) -> str:
    line = f"[{prefix}] turn {turn}: the file src/mod_{turn}.py reads data, parses it and writes the report. "
    return (line * (chars // len(line) + 1))[:chars]


CORE_PARTS = tuple(f.name for f in fields(CoreTimeline))


async def floor(model_dir: str, turns: int, chars: int, max_tokens: int, max_len: int,
                core: list[dict[str, float]], threads: int) -> list[float]:
    """AsyncLLM fed token ids: each turn's prompt = previous prompt + output + the new message's tokens.
    The model runs in vLLM's engine core process on `threads` OpenMP threads."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The engine core process sizes its pool from it; the systems started after this one (loopserve's
    # Ray, vLLM's server) do not inherit it.
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": str(threads)}):
        return await _floor_loop(model_dir, turns, chars, max_tokens, max_len, core)


async def _floor_loop(model_dir: str, turns: int, chars: int, max_tokens: int, max_len: int,
                      core: list[dict[str, float]]) -> list[float]:
    from cluster.torch_extras import STARTUP_DIR, expand_startup_env

    if STARTUP_DIR not in os.environ.get("PYTHONPATH", ""):  # vLLM inspects the model in a subprocess
        os.environ["PYTHONPATH"] = expand_startup_env(dict(os.environ))["PYTHONPATH"]
    from transformers import AutoTokenizer
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from cluster.engines.vllm.engine import PreemptionCounter, core_timeline

    tok = AutoTokenizer.from_pretrained(model_dir)
    # A stat logger keeps vLLM's request stats on (the core's marks), as in loopserve's engine.
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, enforce_eager=True, dtype="float32",
                                                    max_model_len=max_len, enable_prefix_caching=True,
                                                    block_size=BLOCK, seed=0, disable_log_stats=True),
                                    stat_loggers=[PreemptionCounter().factory])
    prefix = secrets.token_hex(8)
    prompt: list[int] = []
    times = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    try:
        for i in range(turns):
            msg = tok.apply_chat_template([{"role": "user", "content": _message(i, chars, prefix)}], tokenize=False,
                                          add_generation_prompt=True)
            if prompt:  # a template's default system prompt opens the conversation only
                msg = msg[msg.index("<|im_start|>user"):]
            prompt = prompt + tok.encode(msg, add_special_tokens=False)
            t0, called_at = time.perf_counter(), time.monotonic()
            out: list[int] = []
            async for o in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=f"floor-{i}"):
                out.extend(o.outputs[0].token_ids)
                if o.finished:
                    marks = core_timeline(o.metrics, called_at, time.monotonic())
                    if marks is not None:
                        core.append({k: getattr(marks, k) for k in CORE_PARTS})
            times.append(time.perf_counter() - t0)
            prompt = prompt + out + tok.encode("<|im_end|>\n", add_special_tokens=False)
    finally:
        llm.shutdown()
    return times


async def ws_chain(url: str, turns: int, chars: int, max_tokens: int, model: str) -> list[float]:
    from websockets.asyncio.client import connect

    from cluster.bench.client import ws_turn, ws_url

    prefix = secrets.token_hex(8)
    times = []
    async with connect(ws_url(url), max_size=None, compression=None, open_timeout=60) as ws:
        prev = None
        for i in range(turns):
            seen = await ws_turn(ws, {"model": model, "store": False, "previous_response_id": prev,
                                      "max_output_tokens": max_tokens, "temperature": 0,
                                      "input": _message(i, chars, prefix)}, keep_events=False)
            prev = seen.response["id"]  # raises on a refused turn
            times.append(seen.wall_s)
    return times


async def http_chain(url: str, turns: int, chars: int, max_tokens: int, model: str) -> list[float]:
    import httpx

    prefix = secrets.token_hex(8)
    times = []
    async with httpx.AsyncClient(timeout=600) as client:
        prev = None
        for i in range(turns):
            body: dict[str, Any] = {"model": model, "input": _message(i, chars, prefix), "max_output_tokens": max_tokens,
                                    "temperature": 0, "store": True}
            if prev:
                body["previous_response_id"] = prev
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/responses", json=body)
            times.append(time.perf_counter() - t0)
            r.raise_for_status()
            prev = r.json()["id"]
    return times


def run_loopserve(model: str, turns: int, chars: int, max_tokens: int, ingress: str = "haproxy",
                  executor: str = "auto", core: Optional[list[dict[str, float]]] = None,
                  threads: Optional[int] = None, config: Optional[dict[str, Any]] = None,
                  transport: str = "ws") -> list[float]:
    """`config`: the app's config over the benchmark's own (merged key by key); `transport`: `ws`
    (WebSocket mode) or `http` (plain POSTs chained by previous_response_id, as the peer's)."""
    from cluster.bench.local import stats
    from cluster.bench.runner import _local_cluster

    vllm = {"block_size": BLOCK, "default_max_tokens": max_tokens, "executor": executor, "cpu_threads": threads}
    args = _merged({"engine": {"backend": "vllm", "vllm": vllm},
                    "model": {"name": model, "builtin": model, "max_model_len": MAX_LEN[model]},
                    "store": {"backend": "none"}, "safety": {"enabled": False}}, config or {})
    url = _local_cluster(ingress=ingress, args=args)
    try:
        chain = ws_chain if transport == "ws" else http_chain
        times = asyncio.run(chain(url, turns, chars, max_tokens, model))
        if core is not None:
            server = [t for t in stats(url)["turns"] if t["prompt_tokens"]][-turns:]
            core.extend({k: t[name] for k, name in zip(CORE_PARTS, ENGINE_CORE_TIMINGS)}
                        for t in server)
        return times
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def run_peer(model_dir: str, turns: int, chars: int, max_tokens: int, max_len: int,
             threads_bind: Optional[str] = None) -> list[float]:
    """vLLM's own server on the same model, dtype, block size and threads (`threads_bind`: its
    VLLM_CPU_OMP_THREADS_BIND; "auto" is vLLM's default, which keeps a core for its API process)."""
    from cluster.bench.peers import vllm_server

    with vllm_server(model_dir, served_name="peer", max_len=max_len, block_size=BLOCK, dtype="float32",
                     threads_bind=threads_bind) as url:
        return asyncio.run(http_chain(url, turns, chars, max_tokens, "peer"))


def _report(name: str, times: list[float], base: float, core: list[dict[str, float]]) -> str:
    line = (f"{name:13s} loop {sum(times):7.2f} s   {sum(times) / base:5.2f}x the floor   "
            f"turns 1-5 mean {sum(times[:5]) / 5 * 1000:6.1f} ms   last turn {times[-1] * 1000:6.1f} ms")
    if core:
        n = len(core)
        mean = {k: sum(c[k] for c in core) / n * 1000 for k in CORE_PARTS}
        model = mean["prefill_s"] + mean["decode_s"]
        rest = sum(times[-n:]) / n * 1000 - sum(mean.values())
        line += (f"\n              per turn in vLLM: model {model:6.1f} ms (prefill {mean['prefill_s']:.1f}, decode "
                 f"{mean['decode_s']:.1f})  queued {mean['queued_s']:.2f}  to core {mean['to_core_s']:.2f}  "
                 f"back {mean['back_s']:.2f}  |  outside vLLM {rest:.1f} ms")
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="loopserve bench vllm-compare", description=__doc__)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--message-chars", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every system, each round in the other order")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--executors", default="auto",
                    help="loopserve runs, one per CPU executor named (of auto, mp, uni): `mp,uni` compares them")
    ap.add_argument("--model", choices=sorted(MAX_LEN), default=TINY)
    ap.add_argument("--threads", default="",
                    help="the model's CPU threads, the same for every system (comma list: each count in turn; "
                         "default: every core this process may use)")
    ap.add_argument("--transports", default="ws", help="loopserve's clients: ws (WebSocket mode), http "
                    "(plain POSTs chained by previous_response_id, as vLLM's server is driven); comma list")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="also loopserve with this config over the benchmark's own, e.g. "
                         "si4='{\"engine\": {\"vllm\": {\"stream_interval\": 4}}}' (repeatable)")
    ap.add_argument("--peer-default", action="store_true",
                    help="also vLLM's server as it starts by default (VLLM_CPU_OMP_THREADS_BIND=auto: a core "
                         "kept for its API process, the model on the rest)")
    add_ingress_argument(ap)
    ns = ap.parse_args(argv)
    from cluster.engines.vllm.engine import cpu_threads_bind
    from cluster.models.builtin import ensure_builtin

    model_dir, max_len = str(ensure_builtin(ns.model)), MAX_LEN[ns.model]
    args = (ns.turns, ns.message_chars, ns.max_tokens)
    counts = [int(t) for t in ns.threads.split(",")] if ns.threads else [len(cpu_threads_bind(None, None).split(","))]
    systems: list[tuple[str, Any]] = []
    for n in counts:
        at = f"@{n}t" if len(counts) > 1 else ""
        systems.append((f"floor{at}", lambda core, n=n: asyncio.run(floor(model_dir, *args, max_len, core, n))))
        for executor in ns.executors.split(","):
            for transport in ns.transports.split(","):
                name = f"loopserve-{transport}" + ("" if executor == "auto" else f"-{executor}") + at
                systems.append((name, lambda core, e=executor, n=n, t=transport:
                                run_loopserve(ns.model, *args, ns.ingress, e, core, n, transport=t)))
        for variant in ns.variant:
            name, _, body = variant.partition("=")
            systems.append((f"loopserve-{name}{at}", lambda core, n=n, c=json.loads(body):
                            run_loopserve(ns.model, *args, ns.ingress, "auto", core, n, c)))
        if not ns.skip_peer:
            bind = cpu_threads_bind(None, n)
            systems.append((f"vllm-server{at}", lambda core, b=bind: run_peer(model_dir, *args, max_len, b)))
    if ns.peer_default and not ns.skip_peer:
        systems.append(("vllm-server-default", lambda core: run_peer(model_dir, *args, max_len, "auto")))
    rounds: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        result: dict[str, Any] = {}
        for name, run in (systems if r % 2 == 0 else systems[::-1]):
            core: list[dict[str, float]] = []
            result[name] = {"turn_seconds": run(core), "core": core}
        rounds.append(result)
    print(f"\nreal engine (vLLM, {ns.model}, CPU): {ns.turns} turns, +{ns.message_chars} chars/turn, "
          f"{ns.max_tokens} output tokens, {ns.rounds} round(s)")
    floors = [name for name, _ in systems if name.startswith("floor")]
    for r, result in enumerate(rounds):
        base = sum(result[floors[0]]["turn_seconds"])  # the first thread count's floor
        print(f"round {r + 1}")
        for name, _ in systems:
            print(_report(name, result[name]["turn_seconds"], base, result[name]["core"]))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_compare.json").write_text(json.dumps({"args": vars(ns), "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
