"""Structured-output schemas compiled under a time limit, in a worker process, before the engine
sees them: the real compiler (xgrammar) with the model's tokenizer."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from cluster.core.turn.controls import MAX_SCHEMA_EXPANSION, check_grammar_cost
from cluster.engines.vllm.grammar_gate import GrammarGate, GrammarTooComplex, request_schemas
from cluster.protocol.errors import ApiError

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(120)

SIMPLE = json.dumps({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})


def slow_schema(n: int) -> dict:
    """Within every static bound (each pattern 1,800 elements, all of them under the schema's
    total), yet the compiler's time grows with every property."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^(a|b){900}$"}
                                             for i in range(n)}}


async def test_a_slow_schema_is_refused_at_the_limit_and_others_are_not_held_behind_it(tiny_model_dir):
    check_grammar_cost(slow_schema(10), "text.format.schema")  # the static checks let it through
    gate = GrammarGate(str(tiny_model_dir), time_limit_s=0.3)
    try:
        await gate.check([SIMPLE])  # starts the worker; compiles once
        # The event loop (every other session of the replica) keeps running while a compile is
        # timed: a ticker measures the longest stall.
        stalls, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                stalls.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        with pytest.raises(GrammarTooComplex, match="did not compile within 0.3 s"):
            await gate.check([json.dumps(slow_schema(10))])
        refused_in = time.perf_counter() - t0
        stop.set()
        await tick
        assert refused_in < 2.0 and gate.refused == 1
        assert max(stalls) < 0.2, max(stalls)
        # the worker was replaced: the next schema compiles, and a known one passes at once
        await gate.check([json.dumps({"type": "array", "items": {"type": "integer"}})])
        t0 = time.perf_counter()
        await gate.check([SIMPLE])
        assert time.perf_counter() - t0 < 0.01
    finally:
        gate.close()


async def test_a_schema_the_compiler_rejects_is_a_value_error(tiny_model_dir):
    gate = GrammarGate(str(tiny_model_dir), time_limit_s=5)
    try:
        with pytest.raises(ValueError, match="cannot be compiled"):
            await gate.check([json.dumps({"type": "string", "pattern": "(unclosed"})])
    finally:
        gate.close()


def test_many_patterns_within_their_own_bounds_add_up_to_a_400():
    with pytest.raises(ApiError) as err:
        check_grammar_cost(slow_schema(MAX_SCHEMA_EXPANSION // 1800 + 1), "text.format.schema")
    assert err.value.code == "invalid_value" and "together" in err.value.message


def test_the_schemas_a_request_makes_the_engine_compile():
    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
    fmt = {"type": "json_schema", "schema": {"type": "integer"}}
    assert request_schemas(fmt, [tool], forced=False) == ['{"type": "integer"}']
    assert request_schemas(fmt, [tool], forced=True) == ['{"type": "object"}']  # a forced call wins
    assert request_schemas(None, [tool], forced=False) == []
    other = {"type": "function", "function": {"name": "write", "parameters": {"type": "string"}}}
    # vLLM compiles one grammar over every tool of a forced call: the gate compiles them as one
    assert request_schemas(None, [tool, other], forced=True) == ['{"anyOf": [{"type": "object"}, {"type": "string"}]}']


async def test_new_schemas_wait_for_the_compiler_a_bounded_time(tiny_model_dir):
    """A client sending slow schemas one after another (each refused at the limit)
    does not queue every other new schema behind them: past twice the limit, a 429."""
    from cluster.engines.vllm.grammar_gate import GrammarBusy

    gate = GrammarGate(str(tiny_model_dir), time_limit_s=0.3)
    try:
        await gate.check([SIMPLE])
        slow = [json.dumps({**slow_schema(10), "title": f"v{i}"}) for i in range(4)]
        outcomes = await asyncio.gather(*(gate.check([s]) for s in slow), return_exceptions=True)
        kinds = sorted(type(o).__name__ for o in outcomes)
        assert "GrammarTooComplex" in kinds and "GrammarBusy" in kinds, kinds
        busy = next(o for o in outcomes if isinstance(o, GrammarBusy))
        assert busy.retry_after_s == pytest.approx(0.6)
        await gate.check([json.dumps({"type": "boolean"})])  # and the gate works on afterwards
    finally:
        gate.close()
