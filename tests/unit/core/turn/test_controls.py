"""Output controls without Ray: what is refused up front (400 in the API's shape), the
tool-call limit, truncation: auto, reasoning.effort through the chat template."""

import pytest
from transformers import AutoTokenizer

from cluster.core.render.renderer import template_effort_kwargs
from cluster.core.render.tokenizer import renderer_for
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.context import normalize_tools
from cluster.core.turn.controls import check_output_controls, tool_call_limit
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.engines.output_parser import TOOL_FORMATS
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request
from tests.support.harness import InProcessStack

TOOLS = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]


def refused(body, can_force=True):
    req = parse_request(body)
    with pytest.raises(ApiError) as err:
        check_output_controls(req, normalize_tools(req.tools), model="m", can_force_tool_calls=can_force)
    return err.value


def test_requests_a_model_cannot_honour_are_400s():
    err = refused({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}})
    assert (err.status, err.param, err.code) == (400, "text.format.schema", "missing_required_parameter")
    err = refused({"input": "x", "tool_choice": "required"})
    assert (err.status, err.param) == (400, "tool_choice") and "'required'" in err.message
    err = refused({"input": "x", "tools": TOOLS, "tool_choice": "required"}, can_force=False)
    assert err.code == "unsupported_value" and "cannot be forced" in err.message
    req = parse_request({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "read_file"},
                         "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})
    check_output_controls(req, normalize_tools(req.tools), model="m", can_force_tool_calls=True)
    # No logprobs come back: asking for them is refused, not silently answered without them.
    err = refused({"input": "x", "top_logprobs": 5})
    assert (err.status, err.param, err.code) == (400, "top_logprobs", "unsupported_parameter")
    req = parse_request({"input": "x", "top_logprobs": 0})
    check_output_controls(req, [], model="m", can_force_tool_calls=True)


def test_parallel_tool_calls_false_keeps_one_call():
    assert tool_call_limit(parse_request({"input": "x", "parallel_tool_calls": False})) == 1
    assert tool_call_limit(parse_request({"input": "x", "max_tool_calls": 3})) == 3
    assert tool_call_limit(parse_request({"input": "x"})) is None


def test_the_forcible_formats_are_the_ones_vllm_has_structural_tags_for():
    pytest.importorskip("vllm")
    from cluster.engines.vllm.constraints import structural_tag_model

    for name, fmt in TOOL_FORMATS.items():
        assert fmt.forcible == (structural_tag_model(name) is not None), name


def test_reasoning_effort_goes_to_the_templates_own_argument(tiny_model_dir):
    import pathlib

    import vllm

    assert template_effort_kwargs("{{ reasoning_effort }}", "high") == {"reasoning_effort": "high"}
    assert template_effort_kwargs("{% if enable_thinking %}", "none") == {"enable_thinking": False}
    assert template_effort_kwargs("plain", "none") == {}
    with pytest.raises(ApiError) as err:
        template_effort_kwargs("plain", "high")
    assert err.value.param == "reasoning.effort" and err.value.status == 400
    # MiniCPM-V 4.5's Qwen3-style template: effort "none" turns thinking off in the prompt.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = (pathlib.Path(vllm.__file__).parent / "transformers_utils" / "chat_templates" /
                         "template_minicpmv45.jinja").read_text()
    r = renderer_for(tok, probe=False)
    items = [{"type": "message", "role": "user", "content": "hi"}]
    off, on = (r.decode(r.full(items, None, None, effort).assemble(None)[1]) for effort in ("none", "high"))
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("assistant\n<think>\n")


async def test_truncation_auto_drops_the_oldest_turns(tokenizer):
    stack = InProcessStack(tokenizer, max_model_len=1200)
    cache = SessionCache()
    resp = None
    for n in range(4):
        body = {"input": f"turn {n} " + "words " * 100, "truncation": "auto"}
        if resp is not None:
            body["previous_response_id"] = resp["id"]
        evs = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s")))]
        resp = evs[-1]["response"]
        assert resp["status"] in ("completed", "incomplete") and resp["truncation"] == "auto"
        assert resp["usage"]["input_tokens"] < 1200
    state = cache.get(resp["id"])
    texts = [i["content"] for i in state.items if i.get("role") == "user"]
    assert texts[-1].startswith("turn 3") and not any(t.startswith("turn 0") for t in texts)
    # without truncation the same chain is refused
    body = {"input": "more " * 300, "previous_response_id": resp["id"]}
    with pytest.raises(ApiError) as err:
        [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s")))]
    assert err.value.code == "context_length_exceeded"


async def test_a_warm_up_prefills_the_engine(tokenizer):
    """generate: false (or prompt_cache_options.prewarm) caches the state and runs the prompt
    through the engine (one token, discarded): the first real turn hits the warmed prefix."""
    for warm in ({"generate": False}, {"prompt_cache_options": {"prewarm": True}}):
        stack = InProcessStack(tokenizer)
        cache = SessionCache()
        body = {"input": "context " * 200, "instructions": "Be brief.", "tools": TOOLS, **warm}
        evs = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s")))]
        assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.completed"]
        warm_resp = evs[-1]["response"]
        assert warm_resp["output"] == [] and warm_resp["usage"]["output_tokens"] == 0
        assert len(stack.engine_requests) == 1 and stack.engine_requests[0].generation.max_tokens == 1
        body = {"previous_response_id": warm_resp["id"], "input": "go", "instructions": "Be brief.", "tools": TOOLS}
        evs = [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s")))]
        usage = evs[-1]["response"]["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= warm_resp["usage"]["input_tokens"] - 8


async def test_truncation_work_is_bounded_by_the_context_not_the_body(tokenizer):
    stack = InProcessStack(tokenizer, max_model_len=1200)
    items = []
    for n in range(300):  # ~60k tokens of history in one body, 20 turns fit
        items += [{"type": "message", "role": "user", "content": f"turn {n} " + "words " * 30},
                  {"type": "message", "role": "assistant", "content": "ok"}]
    items.append({"type": "message", "role": "user", "content": "and now?"})
    evs = [ev async for ev in stack.driver.run(TurnRequest(parse_request({"input": items, "truncation": "auto"}), TurnScope(SessionCache(), session_key="s")))]
    assert evs[-1]["response"]["usage"]["input_tokens"] < 1200
    full = [job for job in stack.render_jobs if not job.delta]
    # the whole body once (it did not fit), then renders of the newest turns only
    sizes = sorted(len(job.items) for job in full)
    assert len(full) <= 2 + 2 * 9 and sizes[-2] < 200  # O(log turns); no second render of the whole body


def _forced(tools):
    req = parse_request({"input": "x", "tools": tools, "tool_choice": "required"})
    check_output_controls(req, normalize_tools(req.tools), model="m", can_force_tool_calls=True)


def test_a_forced_call_checks_the_functions_nested_in_namespace_tools():
    """The 47-byte ^(a|b){16000}$ took 48 s to compile; inside a namespace tool it
    was forced into the grammar unchecked."""
    bomb = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a|b){16000}$"}}}
    with pytest.raises(ApiError) as err:
        _forced([{"type": "function", "name": "ok", "parameters": {"type": "object"}},
                 {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f", "parameters": bomb}]}])
    assert err.value.param == "tools[1].tools[0].parameters" and "repeats too much" in err.value.message


def test_a_forced_call_bounds_its_functions_and_their_sum():
    from cluster.core.turn.controls import MAX_FORCED_TOOLS, MAX_SCHEMA_EXPANSION

    many = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(MAX_FORCED_TOOLS + 1)]
    with pytest.raises(ApiError) as err:
        _forced(many)
    assert err.value.param == "tools" and str(MAX_FORCED_TOOLS) in err.value.message
    _forced(many[:MAX_FORCED_TOOLS])  # at the bound: fine
    # each function within the schema bound, all of them together over it (one grammar)
    per_tool = MAX_SCHEMA_EXPANSION // 1800 // 2 + 1
    heavy = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^(a|b){900}$"}
                                              for i in range(per_tool)}}
    with pytest.raises(ApiError) as err:
        _forced([{"type": "function", "name": "a", "parameters": heavy},
                 {"type": "function", "name": "b", "parameters": heavy}])
    assert err.value.param == "tools" and "together" in err.value.message
    _forced([{"type": "function", "name": "a", "parameters": heavy}])
