"""The turn's hot path without Ray: typed engine requests, tail prompts, one retry policy,
the scripted engine reading the prompt, one metrics facade."""

from array import array

import pytest

from cluster.core.messages import Generation
from cluster import telemetry
from cluster.core.messages import EngineRequest
from cluster.core.retry import RetryPolicy
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.engines.prompts import SessionPrompts
from cluster.protocol.requests import parse_request
from tests.support.harness import InProcessStack

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


async def run(stack, cache, body, owner=None):
    evs = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s1", owner=owner)))]
    return evs[-1]["response"]


async def tool_loop(stack, cache, turns, owner=None):
    resp = await run(stack, cache, {"input": "read the readme", "tools": TOOLS}, owner)
    for n in range(turns):
        call = resp["output"][0]
        assert call["type"] == "function_call", resp["output"]
        resp = await run(stack, cache, {"previous_response_id": resp["id"], "tools": TOOLS, "input": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": "line\n" * 300},
            {"type": "message", "role": "user", "content": f"and now step {n}"}]}, owner)
        assert resp["status"] == "completed", resp
    return resp


async def test_a_continuation_sends_the_engine_only_its_new_tokens(tokenizer):
    stack = InProcessStack(tokenizer)
    await tool_loop(stack, SessionCache(), 6)
    first, *rest = stack.engine_requests
    assert not first.is_tail
    bases = []
    for prev, req in zip(stack.engine_requests, rest):
        assert req.is_tail and req.base_request_id == prev.request_id
        # the tail is the new turn's tokens (~400 for 300 lines), not the growing history
        assert len(req.prompt_token_ids) < 700
        bases.append(req.base_len)
    assert bases == sorted(bases) and bases[-1] > 5 * 400  # the history stayed on the engine side
    last = stack.driver.metrics.timings[-1]
    assert last.prompt_tokens_sent == len(rest[-1].prompt_token_ids) < last.prompt_tokens / 5


async def test_the_prompt_the_engine_rebuilds_is_the_full_render(tokenizer):
    from cluster.core.turn.context import normalize_tools

    stack = InProcessStack(tokenizer, verify=False)
    cache = SessionCache()
    resp = await tool_loop(stack, cache, 4)
    request_id, ran = stack.prompts._last[(stack.engine_requests[-1].cache_salt, "s1")]
    assert request_id == resp["id"]
    state = cache.get(resp["id"])
    full = stack.renderer.full(state.items[: state.output_start], None, normalize_tools(TOOLS))
    assert ran == full.assemble(None)[1]


async def test_a_tail_whose_base_is_gone_is_resent_whole(tokenizer):
    stack = InProcessStack(tokenizer)
    cache = SessionCache()
    resp = await tool_loop(stack, cache, 1)
    stack.prompts = SessionPrompts()  # the engine replica restarted (or evicted the session)
    call = resp["output"][0]
    resp = await run(stack, cache, {"previous_response_id": resp["id"], "tools": TOOLS, "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]})
    assert resp["status"] == "completed"
    assert [r.is_tail for r in stack.engine_requests[-2:]] == [True, False]
    assert stack.driver.metrics.prompt_resends == 1


def test_a_turns_prompt_is_its_prefix_then_its_generation_prompt_from_any_token_on():
    from cluster.core.turn.turn import Rendered

    prefix, gen = array("i", range(100)), array("i", [7, 8, 9])
    rendered = Rendered(prefix, gen, 0)
    whole = list(range(100)) + [7, 8, 9]
    assert rendered.prompt_len == 103 and rendered.prompt_extends_prefix
    for start in (0, 1, 99, 100, 101, 103):
        assert list(rendered.prompt_from(start)) == whole[start:]
    assert rendered.prompt_from(0) is not prefix and list(prefix) == list(range(100))  # the cached prefix stays
    # A full render cut nowhere safe: the engine gets the override, the prefix is still what is cached
    override = array("i", range(50))
    odd = Rendered(prefix, array("i"), 0, prompt_override=override)
    assert odd.prompt_len == 50 and not odd.prompt_extends_prefix
    assert odd.prompt_from(0) is override and list(odd.prompt_from(10)) == list(range(10, 50))


def test_a_prompt_base_is_per_tenant_and_per_request():
    prompts = SessionPrompts()
    base = EngineRequest("r1", "s", array("i", range(100)), Generation(8), cache_salt="tenant-a")
    prompts.remember(base)
    tail = EngineRequest("r2", "s", array("i", [7, 7]), Generation(8), cache_salt="tenant-a", base_request_id="r1", base_len=90)
    whole = prompts.resolve(tail)
    assert list(whole.prompt_token_ids) == list(range(90)) + [7, 7] and not whole.is_tail
    other_tenant = EngineRequest("r3", "s", array("i", [7]), Generation(8), cache_salt="tenant-b", base_request_id="r1", base_len=90)
    assert prompts.resolve(other_tenant) is None
    stale = EngineRequest("r4", "s", array("i", [7]), Generation(8), cache_salt="tenant-a", base_request_id="r0", base_len=90)
    assert prompts.resolve(stale) is None
    too_long = EngineRequest("r5", "s", array("i", [7]), Generation(8), cache_salt="tenant-a", base_request_id="r1", base_len=101)
    assert prompts.resolve(too_long) is None


def test_session_prompts_are_bounded_by_the_memory_their_entries_take():
    prompts = SessionPrompts(max_tokens=1000)  # 4,000 bytes
    for i in range(50):
        prompts.remember(EngineRequest(f"r{i}", f"s{i}", array("i", range(100)), Generation(1)))
    assert prompts.nbytes <= 4000 and len(prompts) == 3  # 400 bytes of tokens + ~600 an entry
    # tiny prompts do not slip past the bound: each entry costs what Python holds for it
    tiny = SessionPrompts(max_tokens=100_000)
    for i in range(10_000):
        tiny.remember(EngineRequest(f"r{i}", f"s{i}", array("i", range(8)), Generation(1)))
    assert tiny.tokens < 20_000 and len(tiny) < 700 and tiny.nbytes <= 400_000


async def test_the_scripted_engine_reads_who_spoke_last_from_the_prompt(tokenizer):
    stack = InProcessStack(tokenizer)
    cache = SessionCache()
    resp = await run(stack, cache, {"input": "read the readme", "tools": TOOLS})
    assert resp["output"][0]["type"] == "function_call"  # after a user message: a tool call
    call = resp["output"][0]
    resp = await run(stack, cache, {"previous_response_id": resp["id"], "tools": TOOLS, "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "x " * 2000}]})
    assert resp["output"][0]["type"] == "message"  # after a (long) tool result: the answer
    assert not hasattr(stack.engine_requests[-1], "last_item")  # no hint travels to the engine


class Gone(Exception):
    pass


async def test_one_retry_policy_retries_only_what_it_is_told():
    policy = RetryPolicy(retries=2, backoff_s=0.001)
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise Gone()
        return "ok"

    assert await policy.call("x", flaky, lambda e: isinstance(e, Gone)) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(Gone):
        await policy.call("x", lambda: flaky(), lambda e: False)
    assert len(calls) == 1
    calls.clear()

    async def always():
        calls.append(1)
        raise Gone()

    with pytest.raises(Gone):
        await policy.call("x", always, lambda e: True)
    assert len(calls) == 3  # the first try and two retries


async def test_a_stream_is_retried_only_before_its_first_item():
    policy = RetryPolicy(retries=3, backoff_s=0.001)
    opened = []

    async def dies_at_once():
        opened.append("a")
        if len(opened) < 2:
            raise Gone()
        yield 1
        yield 2

    assert [x async for x in policy.stream("s", dies_at_once, lambda e: True)] == [1, 2] and len(opened) == 2
    opened.clear()

    async def dies_mid_stream():
        opened.append("b")
        yield 1
        raise Gone()

    got = []
    with pytest.raises(Gone):
        async for x in policy.stream("s", dies_mid_stream, lambda e: True):
            got.append(x)
    assert got == [1] and len(opened) == 1  # its items were used: not replayed


def test_a_deadline_policy_gives_up_after_its_deadline():
    import time

    policy = RetryPolicy(backoff_s=1.0, deadline_s=2.5)
    now = time.monotonic()
    assert not policy.gives_up(0, now)  # 1 s wait fits
    assert policy.gives_up(0, now - 2.0)  # 2 s gone + 1 s wait > 2.5 s
    assert [policy.delay(a) for a in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


async def test_the_metrics_facade_counts_once_for_stats_and_for_opentelemetry(tokenizer):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    metrics = telemetry.Metrics(MeterProvider(metric_readers=[reader]).get_meter("t"))
    stack = InProcessStack(tokenizer, metrics=metrics)
    await tool_loop(stack, SessionCache(), 2)
    assert metrics.turn_status == {"completed": 3}
    assert len(metrics.timings) == 3 and metrics.recent_turns(2)[-1]["prompt_tokens"] > 0
    points = {m.name: list(m.data.data_points) for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    assert sum(p.value for p in points["loopserve.turns"]) == 3
    assert points["loopserve.turn.overhead"][0].count == 3
