"""The engine model the KV policy is judged against at GPU speed (`scripted/cost_model.py`): its
shape (attention grows with context, decode is bound by weights until KV reads take over, chunked
prefill shares steps with decode), its calibration against published vLLM numbers, and the
scripted engine's clock that runs it (`scripted/step_clock.py`)."""

import asyncio
import dataclasses
import typing
from array import array

import pytest

from cluster.config import ModelConfig, ScriptedEngineConfig
from cluster.core.messages import EngineRequest, Generation
from cluster.engines.scripted.cost_model import PRESETS, EngineCostModel
from cluster.engines.scripted.engine import ScriptedEngine
from cluster.engines.scripted.step_clock import StepClock

H100 = PRESETS["h100-8b"]


def test_the_config_names_every_preset():
    assert set(typing.get_args(typing.get_args(ScriptedEngineConfig.model_fields["preset"].annotation)[0])) == set(PRESETS)


def test_the_h100_preset_reproduces_published_vllm_numbers():
    # vLLM's nightly latency test (buildkite vllm/performance-benchmark #9515): Llama-3.1-8B, tp 1, on an H200
    # (4.8 TB/s), batch 8, 32 tokens in, 128 out: 833 ms median, 6.5 ms a step. The same engine, the H200's bandwidth.
    h200 = dataclasses.replace(H100, bandwidth=0.8 * 4.8e12)
    assert 833 / 128 * 0.9 <= 1000 * h200.decode_step(8, 32 + 64) <= 833 / 128 * 1.1
    # One request decoding on an H100: 120-130 tokens/s (16 GB of weights read a step).
    assert 0.0075 <= H100.decode_step(1, 512) <= 0.0085
    # Prefill of short prompts: 25-35k tokens/s (half the dense bf16 peak).
    assert 25_000 <= 4096 / H100.prefill_time(4096) <= 35_000
    # Llama-3.1-8B's KV: 128 KiB a token; the pool holds three 128k-token sessions.
    assert H100.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert 3 * 128_000 <= H100.kv_capacity_tokens < 4 * 128_000


def test_prefill_costs_more_the_longer_the_context_it_extends():
    short, long = H100.prefill_time(2000, 0), H100.prefill_time(2000, 100_000)
    assert long > 3 * short
    assert H100.prefill_time(2000, 30_000) < long
    # a 100k prompt in one go costs more than 50 x a 2k one (quadratic attention)
    assert H100.prefill_time(100_000) > 50 * short


def test_decode_is_bound_by_weights_at_small_batches_and_by_kv_reads_at_large_ones():
    assert H100.decode_step(8, 1000) < 1.1 * H100.decode_step(1, 1000)  # +8 x 1,000 tokens of KV read
    assert H100.decode_step(64, 30_000) > 5 * H100.decode_step(1, 1000)
    assert H100.decode_step(64, 30_000) > H100.decode_step(64, 3_000)


def test_chunked_prefill_shares_a_step_with_decode():
    decodes = [4000] * 16
    together = H100.step_time(decodes, [(2048, 0)])
    assert together < H100.step_time(decodes) + H100.step_time((), [(2048, 0)])
    assert together > H100.step_time(decodes)


def test_the_lower_bound_is_the_necessary_prefill_and_decode_back_to_back():
    prefill, decode = [(2000, 0)] * 4, [(100, 2000)] * 4
    bound = H100.lower_bound(prefill, decode, concurrency=4)
    assert bound == pytest.approx(4 * H100.prefill_time(2000) + 100 * H100.decode_step(4, 2000))
    assert H100.lower_bound(prefill, decode, concurrency=1) > bound


# A model whose steps are slow enough to count on a busy machine: 20 ms a step, whatever the batch.
SLOW = EngineCostModel(name="slow", params=0, layers=0, attention_width=1, kv_bytes_per_token=0, weight_bytes=0,
                       flops=1.0, bandwidth=1.0, step_overhead_s=0.02, max_batched_tokens=100, kv_capacity_tokens=10**6)


def test_the_clock_batches_decodes_and_chunks_prefills_into_shared_steps():
    async def main():
        clock = StepClock(SLOW)

        async def decode(rid, n):
            clock.start_decode(rid, 10, n)
            for _ in range(n):
                await clock.next_token(rid)

        await asyncio.gather(decode("a", 10), decode("b", 10), clock.prefill(250, 0))
        return clock.steps

    # 10 steps of two decodes each; the 250-token prefill rides in the same steps (98, 98, then 54 tokens)
    assert asyncio.run(main()) == 10


def test_a_slow_reader_finds_its_tokens_made_and_costs_no_steps():
    async def main():
        clock = StepClock(SLOW)
        clock.start_decode("a", 0, 5)
        await asyncio.sleep(SLOW.step_overhead_s * 8)
        steps = clock.steps
        for _ in range(5):
            await clock.next_token("a")
        return steps, clock.steps

    assert asyncio.run(main()) == (5, 5)


def test_the_scripted_engine_runs_on_a_preset():
    engine = ScriptedEngine(ModelConfig(), ScriptedEngineConfig(preset="cpu", answer_text="a b c d", max_output_tokens=4),
                            encode=lambda s: [ord(c) for c in s], decode=lambda ids: "".join(map(chr, ids)))
    assert engine.kv_capacity_tokens >= PRESETS["cpu"].kv_capacity_tokens - engine.kv.block_size

    async def run(prompt):
        out = [d async for d in engine.generate(EngineRequest("r", "s", prompt, Generation(4)))]
        return out[-1].cached_tokens, sum(d.new_tokens for d in out)

    prompt = array("i", range(1, 1001))
    first = asyncio.run(run(prompt))
    assert first == (0, 4)
    assert engine.clock.steps >= 4  # a prefill step, then the decode steps
    assert engine.clock.busy_s >= PRESETS["cpu"].prefill_time(1000)


# This machine's vLLM 0.32 CPU engine, SmolLM2-135M float32, 2 threads, measured by
# `loopserve bench engine-model` (docs/benchmarks.md): seconds for 512 tokens prefilled after a cached context, and
# for a decode step at (batch, context). The `cpu` preset is fitted to them.
CPU_MEASURED_PREFILL = {0: 0.706, 2048: 1.147, 4096: 1.596, 7168: 2.192}
CPU_MEASURED_DECODE = {(1, 64): 0.0394, (8, 64): 0.0439, (1, 4096): 0.0475, (8, 4096): 0.196, (16, 2048): 0.170}


def test_the_cpu_preset_follows_this_machines_vllm_within_a_fifth():
    cpu = PRESETS["cpu"]
    for ctx, measured in CPU_MEASURED_PREFILL.items():
        assert cpu.prefill_time(512, ctx) == pytest.approx(measured, rel=0.2), ctx
    for (batch, ctx), measured in CPU_MEASURED_DECODE.items():
        assert cpu.decode_step(batch, ctx) == pytest.approx(measured, rel=0.2), (batch, ctx)
