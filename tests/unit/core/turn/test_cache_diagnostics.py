"""`prompt_cache_options` and `prompt_cache_diagnostics` (core/turn/cache_diagnostics.py) through the
turn driver over the real renderer and the scripted engine, checked against the openai package's types."""

import pytest
from openai.types.responses import Response

from cluster.core.turn.cache import SessionCache
from cluster.core.turn.cache_diagnostics import CacheCheck, common_prefix, diagnostics
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request
from tests.support.harness import InProcessStack

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
OTHER_TOOLS = [{**TOOLS[0], "description": "Read any file"}]


@pytest.fixture
def stack(tokenizer):
    return InProcessStack(tokenizer)


async def run(stack, cache, body, **kw) -> Response:
    events = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s1", **kw)))]
    return Response.model_validate(events[-1]["response"])


BASE = {"model": "loopserve-tiny", "instructions": "be brief", "tools": TOOLS,
        "input": "Read the README and say what the project does. " * 8}


def compare_to(rid, **extra):
    return {**extra, "prompt_cache_options": {"ttl": "12h", "comparison_response_id": rid}}


async def test_the_applied_options_are_echoed_and_round_trip_through_the_sdk_types(stack):
    cache = SessionCache()
    first = await run(stack, cache, {**BASE, "prompt_cache_options": {"mode": "implicit", "ttl": "12h"}})
    assert first.prompt_cache_options.ttl == "12h" and first.prompt_cache_options.mode == "implicit"
    assert first.prompt_cache_diagnostics is None  # none asked for
    plain = await run(stack, cache, BASE)
    assert plain.prompt_cache_options is None


async def test_a_continuation_that_extends_the_compared_response_is_a_hit(stack):
    cache = SessionCache()
    first = await run(stack, cache, BASE)
    call = first.output[0]
    nxt = await run(stack, cache, {**BASE, "previous_response_id": first.id, **compare_to(first.id),
                                   "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]})
    assert nxt.usage.input_tokens_details.cached_tokens > 0
    assert nxt.prompt_cache_diagnostics.type == "cache_hit"


@pytest.mark.parametrize("change, reason", [
    ({"tools": OTHER_TOOLS}, "tools_changed"),
    ({"instructions": "be very brief"}, "input_changed"),
    ({"input": "Read the LICENSE and say what the project does. " * 8}, "input_changed"),
    ({"prompt_cache_key": "another"}, "prompt_cache_key_changed"),
    ({"text": {"format": {"type": "json_object"}}}, "text_format_changed"),
])
async def test_each_change_is_named_with_the_tokens_it_cost(stack, change, reason):
    cache = SessionCache()
    first = await run(stack, cache, BASE)
    again = await run(stack, cache, {**BASE, **change, **compare_to(first.id)})
    d = again.prompt_cache_diagnostics
    assert d.type == "cache_miss" and d.reason == reason
    assert d.cache_missed_tokens + d.comparison_reusable_tokens == again.usage.input_tokens
    assert d.cache_missed_tokens > 0
    if reason == "input_changed" and "input" in change:
        assert d.comparison_reusable_tokens > 0  # the system prompt and tools before the edit are reusable


async def test_a_model_change_and_a_compaction_are_named(stack):
    cache = SessionCache()
    first = await run(stack, cache, BASE)
    state = cache.get(first.id)
    state.model = "another-model"  # as if the compared response came from another model
    again = await run(stack, cache, {**BASE, **compare_to(first.id)})
    assert again.prompt_cache_diagnostics.reason == "model_changed"
    state.model = first.model
    compacted = [{"type": "compaction", "encrypted_content": "x", "summary": [{"type": "summary_text", "text": "s"}]}]
    from cluster.core.turn.cache_diagnostics import compare

    check = compare(parse_request({**BASE, "input": "more"}), first.model, compacted + [{"type": "message", "role": "user",
                    "content": "more"}], state, first.id)
    assert check.reason == "context_compacted"
    # (the tiny model's template takes no reasoning effort: compared on the request alone)
    effort = compare(parse_request({**BASE, "reasoning": {"effort": "high"}}), first.model, state.items, state, first.id)
    assert effort.reason == "reasoning_effort_changed"


async def test_an_unknown_or_foreign_comparison_is_not_found(stack):
    cache = SessionCache()
    first = await run(stack, cache, BASE, owner="tenant-a")
    missing = await run(stack, cache, {**BASE, **compare_to("resp_nope")}, owner="tenant-a")
    assert missing.prompt_cache_diagnostics.type == "comparison_response_not_found"
    foreign = await run(stack, cache, {**BASE, **compare_to(first.id)}, owner="tenant-b")
    assert foreign.prompt_cache_diagnostics.type == "comparison_response_not_found"


def test_nothing_changed_but_the_prefix_evicted_is_unavailable_not_a_hit():
    check = CacheCheck("resp_1", True, None, None)
    assert diagnostics(check, [1, 2, 3], 3000, cached_tokens=0) == {"type": "unavailable"}
    assert diagnostics(check, [1, 2, 3], 3000, cached_tokens=2944, block_size=128) == {"type": "cache_hit"}
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2


@pytest.mark.parametrize("options", [{"ttl": "1h"}, {"mode": "sometimes"}, {"comparison_response_id": 5},
                                     {"prewarm": "maybe"}])
def test_bad_options_are_a_400_naming_the_field(options):
    with pytest.raises(ApiError) as err:
        parse_request({"model": "m", "input": "x", "prompt_cache_options": options})
    assert err.value.status == 400 and err.value.param.startswith("prompt_cache_options")


def test_a_prompt_that_leaves_the_compared_one_before_its_end_is_a_miss():
    from array import array

    check = CacheCheck("resp_1", True, None, array("i", [1, 2, 3, 4]))
    assert diagnostics(check, [1, 2, 9, 9, 9], 5, cached_tokens=2) == {
        "type": "cache_miss", "reason": "input_changed", "cache_missed_tokens": 3, "comparison_reusable_tokens": 2}


async def test_a_template_that_rerenders_an_earlier_message_is_named_input_changed(tiny_model_dir):
    from tests.unit.core.render.test_probe import shortens_old_tool_outputs, tokenizer_with

    # The template cuts an old tool output once a newer one exists: the items continue the compared
    # response's, its rendered prompt does not (the turn renders in full: content-dependent).
    stack = InProcessStack(tokenizer_with(tiny_model_dir, shortens_old_tool_outputs(200)))
    cache = SessionCache()

    def tool_round(call_id: str, output: str) -> list[dict]:
        return [{"type": "function_call", "call_id": call_id, "name": "read_file", "arguments": "{}"},
                {"type": "function_call_output", "call_id": call_id, "output": output}]

    first = await run(stack, cache, {**BASE, "input": [{"role": "user", "content": "Read it."}, *tool_round("c1", "A" * 500)]})
    second = await run(stack, cache, {**BASE, "previous_response_id": first.id, **compare_to(first.id),
                                      "input": [{"role": "user", "content": "And the other."}, *tool_round("c2", "B")]})
    assert stack.renderer.fallbacks.get("content_dependent_state")  # a new tool output: rendered in full
    diag = second.prompt_cache_diagnostics
    assert diag.type == "cache_miss" and diag.reason == "input_changed" and diag.cache_missed_tokens > 0
