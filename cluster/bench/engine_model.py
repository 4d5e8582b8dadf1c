"""`loopserve bench engine-model`: the scripted engine's `cpu` engine model against this machine's
vLLM CPU engine (SmolLM2-135M, float32, 2 threads): prefill of 512 new tokens after a cached
context of C tokens, and a decode step at batch B and context C, measured and modelled side by
side. The model (engines/scripted/cost_model.py) is fitted to these; rerun after a vLLM upgrade.

    PYTHONPATH=cluster/_startup:. python -m cluster.bench.engine_model
"""

from __future__ import annotations

import argparse
import os
import random
import time

PREFILL_CONTEXTS = (0, 2048, 4096, 7168)
DECODE_SHAPES = ((1, 64), (8, 64), (1, 4096), (8, 4096), (16, 2048))


def measure(rounds: int) -> list[tuple[str, float, float]]:
    """(what, measured s, modelled s) per shape; the measured value is the median of `rounds`."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    from vllm import LLM, SamplingParams

    from cluster.engines.scripted.cost_model import PRESETS
    from cluster.models.builtin import ensure_builtin

    model = PRESETS["cpu"]
    llm = LLM(model=str(ensure_builtin("smollm2-135m-instruct", weights=True)), dtype="float32",
              enable_prefix_caching=True, max_model_len=8192)
    vocab = [i for w, i in llm.get_tokenizer().get_vocab().items() if w.isalpha()][:5000]
    rng = random.Random(0)

    def ids(n: int) -> dict:
        return {"prompt_token_ids": [rng.choice(vocab) for _ in range(n)]}

    def timed(prompts: list, tokens: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    rows = []
    for ctx in PREFILL_CONTEXTS:
        runs = []
        for _ in range(rounds):
            base = ids(ctx)["prompt_token_ids"]
            if base:
                timed([{"prompt_token_ids": base}], 1)  # cached
            runs.append(timed([{"prompt_token_ids": base + ids(512)["prompt_token_ids"]}], 1))
        rows.append((f"prefill 512 after {ctx}", sorted(runs)[len(runs) // 2], model.prefill_time(512, ctx)))
    for batch, ctx in DECODE_SHAPES:
        runs = []
        for _ in range(rounds):
            prompts = [ids(ctx) for _ in range(batch)]
            timed(prompts, 1)  # cached
            runs.append((timed(prompts, 65) - timed(prompts, 1)) / 64)
        rows.append((f"decode step, batch {batch} at {ctx}", sorted(runs)[len(runs) // 2],
                     model.decode_step(batch, ctx)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="loopserve bench engine-model", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args(argv)
    print(f"{'shape':34s} {'vLLM ms':>9s} {'model ms':>9s} {'model/vLLM':>10s}")
    for what, measured, modelled in measure(ns.rounds):
        print(f"{what:34s} {1000 * measured:9.1f} {1000 * modelled:9.1f} {modelled / measured:10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
