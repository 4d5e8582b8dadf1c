"""The scripted engine's modelled KV cache (cluster/engines/scripted/kv_model.py, a stand-in for vLLM's block pool)."""

import asyncio
from array import array

from cluster.core.messages import Generation
from cluster.config import ModelConfig, ScriptedEngineConfig
from cluster.core.messages import EngineRequest
from cluster.engines.scripted.kv_model import KvBlockPool
from cluster.engines.scripted.engine import ScriptedEngine


def toks(seed: int, n: int) -> array:
    return array("i", [(seed * 1_000_003 + i) % 50_000 for i in range(n)])


def test_a_prompt_hits_its_cached_prefix_blocks_and_computes_at_least_one_token():
    kv = KvBlockPool(1024, 32)
    p = toks(1, 100)
    assert kv.allocate("r1", None, p) == 0
    kv.finish("r1", p)
    # the same prompt: 3 full blocks cached, but the last token is always computed
    assert kv.allocate("r2", None, p) == 96
    out = p + toks(5, 30)  # the prompt and 30 generated tokens: 4 full blocks
    kv.finish("r2", out)
    q = out + toks(2, 40)  # the next turn continues prompt + output
    assert kv.allocate("r3", None, q) == 128
    # another tenant's salt never hits
    assert kv.allocate("r4", "other", p) == 0


def test_the_least_recently_freed_blocks_are_evicted_first():
    kv = KvBlockPool(8 * 32, 32)  # 8 blocks
    a, b, c = toks(1, 128), toks(2, 128), toks(3, 128)  # 4 blocks each
    kv.allocate("a", None, a)
    kv.finish("a", a)
    kv.allocate("b", None, b)
    kv.finish("b", b)
    kv.allocate("c", None, c)  # takes a's blocks (freed first)
    kv.finish("c", c)
    assert kv.allocate("a2", None, a) == 0
    kv.finish("a2", a)  # a took b's blocks
    assert kv.allocate("c2", None, c) == 96


def test_a_pinned_session_survives_other_sessions_traffic_until_unpinned():
    kv = KvBlockPool(8 * 32, 32)
    a, b, c = toks(1, 128), toks(2, 128), toks(3, 128)
    kv.allocate("a", None, a)
    kv.finish("a", a, pin="session-a")
    for i, other in enumerate((b, c, b, c)):
        assert kv.allocate(f"o{i}", None, other) is not None
        kv.finish(f"o{i}", other)
    assert kv.allocate("a2", None, a) == 96
    kv.finish("a2", a)
    assert kv.stats()["kv_pinned_blocks"] == 4  # still pinned (the pin follows the session)
    kv.unpin("session-a")
    assert kv.stats()["kv_pinned_blocks"] == 0


def test_pins_give_way_before_a_request_waits_or_is_preempted():
    kv = KvBlockPool(8 * 32, 32)
    a, big = toks(1, 128), toks(2, 8 * 32)
    kv.allocate("a", None, a)
    kv.finish("a", a, pin="session-a")
    assert kv.allocate("big", None, big) == 0
    assert kv.pins_dropped_under_pressure == 1 and kv.preemptions == 0


def test_a_running_request_that_cannot_grow_preempts_the_newest():
    kv = KvBlockPool(4 * 32, 32)
    kv.allocate("old", None, toks(1, 64))  # 2 blocks
    kv.allocate("new", None, toks(2, 64))  # 2 blocks: the pool is full
    assert not kv.grow("old", 65)
    assert kv.preempt_newest() == "new"
    assert kv.grow("old", 65)
    assert kv.preemptions == 1 and not kv.is_running("new")


def test_the_scripted_engine_reports_hits_from_the_modelled_cache_and_preempts_under_pressure():
    cfg = ScriptedEngineConfig(kv_capacity_tokens=6 * 32, kv_block_size=32, tokens_per_second=10_000,
                               prefill_tokens_per_second=10**7, answer_text="x " * 40, max_output_tokens=40)
    engine = ScriptedEngine(ModelConfig(), cfg, encode=lambda s: [ord(c) for c in s],
                            decode=lambda ids: "".join(map(chr, ids)))

    async def run(rid: str, prompt: array) -> int:
        cached = 0
        async for d in engine.generate(EngineRequest(rid, rid, prompt, Generation(40))):
            cached = d.cached_tokens
        return cached

    async def main() -> tuple[int, int, list[int]]:
        p = toks(1, 70)
        first = await run("a", p)
        second = await run("b", p)
        both = await asyncio.gather(run("c", toks(2, 90)), run("d", toks(3, 90)))
        return first, second, both

    first, second, _ = asyncio.run(main())
    assert (first, second) == (0, 64)
    assert engine.kv.preemptions >= 1  # two 130-token requests cannot both grow in 192 tokens


def test_blocks_evicted_from_the_pool_are_found_in_the_lower_tier_and_loaded_back():
    kv = KvBlockPool(8 * 32, 32, lower_tokens=16 * 32)  # 8 blocks in the engine, 16 below
    a, b, c = toks(1, 128), toks(2, 128), toks(3, 128)
    for rid, p in (("a", a), ("b", b), ("c", c)):
        kv.allocate(rid, None, p)
        kv.finish(rid, p)  # c took a's blocks: a's content went down a tier
    assert kv.allocate("a2", None, a) == 96  # 3 blocks hit, all loaded from below
    assert kv.last_loaded_tokens == 96
    kv.finish("a2", a)
    assert kv.allocate("a3", None, a) == 96 and kv.last_loaded_tokens == 0  # back in the pool now
    stats = kv.stats()
    assert stats["lower_tier_loaded_tokens"] == 96 and stats["lower_tier_stored_tokens"] >= 128


def test_without_a_lower_tier_or_past_its_capacity_an_evicted_prefix_is_computed_again():
    for lower in (0, 2 * 32):  # none; room for 2 blocks, LRU: b's and c's evictions push a's out
        kv = KvBlockPool(4 * 32, 32, lower_tokens=lower)
        a, b, c = toks(1, 128), toks(2, 128), toks(3, 128)
        for rid, p in (("a", a), ("b", b), ("c", c)):
            kv.allocate(rid, None, p)
            kv.finish(rid, p)
        assert kv.allocate("a2", None, a) == 0


def test_the_scripted_engine_charges_a_load_from_the_lower_tier_at_its_rate_not_as_prefill():
    cfg = ScriptedEngineConfig(kv_capacity_tokens=8 * 32, kv_block_size=32, tokens_per_second=10**6,
                               prefill_tokens_per_second=1_000, kv_lower_tier_tokens=64 * 32,
                               kv_lower_tier_tokens_per_second=10**6, answer_text="", max_output_tokens=1)
    engine = ScriptedEngine(ModelConfig(), cfg, encode=lambda s: [ord(c) for c in s],
                            decode=lambda ids: "".join(map(chr, ids)))
    assert engine.lower_tier_tokens_per_s == 10**6  # what the KV budget weighs an eviction by

    async def run(rid: str, prompt: array) -> tuple[int, float]:
        cached, t0 = 0, asyncio.get_running_loop().time()
        async for d in engine.generate(EngineRequest(rid, rid, prompt, Generation(1))):
            cached = d.cached_tokens
        return cached, asyncio.get_running_loop().time() - t0

    async def main():
        a = toks(1, 200)
        await run("a", a)  # 200 tokens of prefill: 0.2 s
        await run("b", toks(2, 200))  # evicts a's blocks into the tier
        return await run("a2", a)

    cached, took = asyncio.run(main())
    assert cached == 192  # 6 blocks back from the tier; the last 8 tokens computed
    assert took < 0.1  # 8 tokens of prefill + 192 copied: not the 0.19 s a re-prefill costs
