"""Model families other than ChatML through the whole Serve app, driven by real clients: the
Open Responses suite's requests, the `openai` SDK's tool loop over HTTP (plain and streamed) and
WebSocket mode, and the Agents SDK's, on gpt-oss (harmony) and Qwen3 (a reasoning template). The
engine is the scripted one (the named stand-in for a model): it writes what the family's model
writes - harmony channels for gpt-oss, read back from the tokens by openai-harmony's parser;
`<think>` then `<tool_call>` JSON for Qwen3 - and the prompts are the family's real tokenizer and
renderer's, so every prompt the engine gets is the one the real model would get. Each family's
tiny random-weight model also runs a 20-turn tool loop on the real engine (vLLM's CPU engine).

What a user relies on: reasoning and calls come back as Responses items and events, reasoning
round-trips (chained by `previous_response_id`, and stateless with
`include: ["reasoning.encrypted_content"]`), and a chained tool loop renders only its new items."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest

from cluster.engines.scripted.engine import example_arguments
from cluster.models.names import TINY_DEEPSEEK_R1, TINY_GPTOSS, TINY_LLAMA3, TINY_QWEN3, TINY_QWEN3_CODER
from tests.integration.test_open_responses import CASES, RESPONSE_RESOURCE, sse_final_response
from tests.support.apps import module_app, scripted_app
from tests.support.local_cluster import stats
from tests.support.ws import sdk_response

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
ANSWER = "The weather in Paris is mild; nothing else is needed."
TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time in a city.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "offset": {"type": "integer"}},
                            "required": ["city", "offset"]}}


@dataclass(frozen=True)
class Family:
    model: str
    url: str
    reasons: bool  # its model writes reasoning before a call or an answer
    calls: int  # calls it writes in one turn when two tools are offered
    new_query: str  # why a new user query after a final answer renders in full ("": it renders incrementally)
    renders_reasoning: bool = True  # its template renders earlier reasoning into the prompt (R1's never does)

    def call_turn(self, n: int = 1) -> list[str]:
        return ["reasoning"] * self.reasons + ["function_call"] * n

    def answer_turn(self) -> list[str]:
        return ["reasoning"] * self.reasons + ["message"]


# name -> (built-in model, model settings, scripted engine settings (it writes the family's format), reasons,
# calls a turn, why a new query renders in full[, renders reasoning])
FAMILIES = {
    # harmony: analysis, then one call (`<|call|>` ends the turn); reasoning is dropped before a final answer
    "gpt-oss": (TINY_GPTOSS, {}, {}, True, 1, "final_answer_drops_reasoning"),
    # <think>, then Hermes JSON calls; a new last user query drops the earlier thinking
    "qwen3": (TINY_QWEN3, {}, {"thinks": True, "calls_per_turn": 2}, True, 2, "content_dependent_state"),
    # XML calls, several a turn
    "qwen3-coder": (TINY_QWEN3_CODER, {"tool_parser": "qwen3_xml"}, {"calls_per_turn": 2}, False, 2, ""),
    # the call as a bare JSON object, one a turn; tool outputs as ipython turns
    "llama3": (TINY_LLAMA3, {"tool_parser": "llama3_json"},
               {"turn_marker": "<|start_header_id|>", "tool_result_marker": "ipython"}, False, 1, ""),
    # <think>, then calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>; the template renders no reasoning back
    "deepseek-r1": (TINY_DEEPSEEK_R1, {"tool_parser": "deepseek_v3", "reasoning_parser": "deepseek_r1"},
                    {"thinks": True, "calls_per_turn": 2, "user_marker": "<｜User｜>",
                     "tool_result_marker": "<｜tool▁outputs▁end｜>"}, True, 2, "", False),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, serve_instance):
    model, settings, scripted = FAMILIES[request.param][:3]
    args = scripted_app({"answer_text": ANSWER, "tokens_per_second": 400, "max_output_tokens": 256, **scripted},
                        model={"name": model, "builtin": model, "max_model_len": 16384, **settings})
    for url in module_app(f"{request.param}-scripted", f"/{request.param}", args, serve_instance, 240):
        yield Family(model, url, *FAMILIES[request.param][3:])


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-test", timeout=120, max_retries=0)


def kinds(response) -> list[str]:
    return [item.type for item in response.output]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_open_responses_suite_passes(family, case):
    body, streaming, expected = CASES[case]
    r = httpx.post(family.url + "/v1/responses", json={"model": family.model, **body, "stream": streaming},
                   headers={"authorization": "Bearer sk-test"}, timeout=60)
    assert r.status_code == 200, r.text
    response = sse_final_response(r.text)[0] if streaming else r.json()
    jsonschema.validate(response, RESPONSE_RESOURCE)
    assert any(item["type"] == expected for item in response["output"]), response["output"]
    # the family's reasoning (harmony's analysis channel, Qwen3's <think>) is an item before the call or answer
    assert (response["output"][0]["type"] == "reasoning") == family.reasons, response["output"]


def test_a_chained_sdk_tool_loop_over_http_gets_reasoning_calls_and_the_answer(family):
    c = client(family.url)
    before = stats(family.url)["render_inline"]
    first = c.responses.create(model=family.model, input="Weather and time in Paris?", tools=[TOOL, TIME_TOOL])
    assert kinds(first) == family.call_turn(family.calls), first.output
    if family.reasons:
        assert first.output[0].content[0].type == "reasoning_text" and "get_weather" in first.output[0].content[0].text
    calls = [item for item in first.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather", "get_time"][:family.calls]
    # arguments are the JSON the tool's schema says, typed (the family writes them as JSON or as XML text)
    assert [json.loads(c.arguments) for c in calls] == [
        example_arguments(t["parameters"]) for t in (TOOL, TIME_TOOL)][:family.calls]
    assert len({c.call_id for c in calls}) == family.calls
    second = c.responses.create(model=family.model, previous_response_id=first.id, tools=[TOOL, TIME_TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"} for call in calls])
    assert kinds(second) == family.answer_turn(), second.output
    assert second.output_text == ANSWER
    # the continuation reused the engine's prefix, and rendered only its new items
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2, second.usage
    after = stats(family.url)["render_inline"]
    assert after["delta_renders"] - before["delta_renders"] >= 1, after


def test_a_streamed_turn_sends_reasoning_and_call_deltas(family):
    c = client(family.url)
    events = list(c.responses.create(model=family.model, input="Weather in Oslo?", tools=[TOOL], stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    assert ("response.reasoning_text.delta" in types) == ("response.reasoning_text.done" in types) == family.reasons
    if family.reasons:  # the reasoning item closes before the call opens, as the model wrote them
        assert types.index("response.reasoning_text.done") < types.index("response.function_call_arguments.delta")
    final = events[-1].response
    assert kinds(final) == family.call_turn()


def test_stateless_reasoning_round_trips_sealed(family):
    """A stateless client (store=false) carries the reasoning back sealed; the server reads it
    into the prompt (harmony keeps analysis that comes before the calls the outputs answer)."""
    if not family.reasons:
        pytest.skip("the family writes no reasoning to carry")
    c = client(family.url)
    question = {"role": "user", "content": "What is the weather in Rome?"}
    first = c.responses.create(model=family.model, input=[question], tools=[TOOL], store=False,
                               include=["reasoning.encrypted_content"])
    reasoning, call = first.output
    assert reasoning.encrypted_content and "get_weather" not in reasoning.encrypted_content  # sealed, not plain
    carried = [question, reasoning.model_dump(exclude_none=True), call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    # the client sends the reasoning without its text (as the SDKs do with store=false)
    carried[1].pop("content", None)
    second = c.responses.create(model=family.model, input=carried, tools=[TOOL], store=False,
                                include=["reasoning.encrypted_content"])
    assert second.output_text == ANSWER
    # the sealed reasoning was read back into the prompt: the same turn chained by id (where the
    # server kept the reasoning) has the same prompt, and one without the reasoning a shorter one
    chained_first = c.responses.create(model=family.model, input=[question], tools=[TOOL])
    chained = c.responses.create(model=family.model, previous_response_id=chained_first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": chained_first.output[1].call_id, "output": "rain"}])
    without = c.responses.create(model=family.model, input=[carried[0], *carried[2:]], tools=[TOOL], store=False)
    assert second.usage.input_tokens == chained.usage.input_tokens, (second.usage, chained.usage)
    # (a template that never renders earlier reasoning, R1's, has the same prompt without it)
    if family.renders_reasoning:
        assert chained.usage.input_tokens > without.usage.input_tokens, (chained.usage, without.usage)
    else:
        assert chained.usage.input_tokens == without.usage.input_tokens, (chained.usage, without.usage)
    altered = {**carried[1], "encrypted_content": carried[1]["encrypted_content"][:-4] + "AAAA"}
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model=family.model, input=[question, altered], store=False)
    assert bad.value.body["code"] == "invalid_encrypted_content"


def test_a_websocket_tool_loop_sends_only_new_items(family):
    c = client(family.url)
    before = stats(family.url)
    with c.responses.connect() as conn:
        first = sdk_response(conn, model=family.model, input="Weather in Lima?", tools=[TOOL])
        assert kinds(first) == family.call_turn()
        call = first.output[-1]
        second = sdk_response(conn, model=family.model, previous_response_id=first.id, tools=[TOOL], input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"}])
        third = sdk_response(conn, model=family.model, previous_response_id=second.id, tools=[TOOL],
                             input="And in Quito?")
    after = stats(family.url)
    assert kinds(second) == family.answer_turn() and kinds(third) == family.call_turn()
    ws = after["turn_transport"].get("websocket", 0) - before["turn_transport"].get("websocket", 0)
    assert ws == 3, after["turn_transport"]
    renders = after["render_inline"]["delta_renders"] - before["render_inline"]["delta_renders"]
    # The tool output's turn rendered only its new items. The next question follows a final answer: a
    # family that then drops the earlier reasoning from the prompt renders that turn in full.
    if family.new_query:
        dropped = (after["render_inline"]["fallbacks"].get(family.new_query, 0)
                   - before["render_inline"]["fallbacks"].get(family.new_query, 0))
        assert (renders, dropped) == (1, 1), after["render_inline"]
    else:
        assert renders == 2, after["render_inline"]


async def test_an_agents_sdk_agent_runs_its_tool_loop(family):
    from agents import Agent, function_tool, set_tracing_disabled
    from agents.responses_websocket_session import responses_websocket_session

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        asked.append(city)
        return f"{city}: sunny"

    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=family.model)
    async with responses_websocket_session(api_key="sk-test", base_url=family.url + "/v1") as session:
        result = await session.run(agent, "Weather in Paris?", auto_previous_response_id=True)
    assert result.final_output == ANSWER
    assert len(asked) == 1 and asked[0], asked
    assert [kinds(r) for r in result.raw_responses] == [family.call_turn(), family.answer_turn()]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_on_vllm(request, serve_instance):
    """The family's tiny model (random weights, the real tokenizer) on the real engine: vLLM's CPU engine."""
    pytest.importorskip("vllm")
    model, settings = FAMILIES[request.param][:2]
    args = {
        "model": {"name": model, "builtin": model, "max_model_len": 8192, **settings},
        "store": {"backend": "none"},
        "engine": {"backend": "vllm", "vllm": {"block_size": 32, "default_max_tokens": 16, "cpu_kvcache_space_gib": 1}},
        "connection": {"ray_actor_options": {"num_cpus": 0.1}}, "render": {"ray_actor_options": {"num_cpus": 0.1}},
        "engine_deployment": {"ray_actor_options": {"num_cpus": 0.5}},
    }
    for url in module_app(f"{request.param}-vllm", f"/{request.param}-vllm", args, serve_instance, 400):
        yield Family(model, url, *FAMILIES[request.param][3:])


@pytest.mark.vllm
def test_a_20_turn_tool_loop_runs_on_the_real_engine(family_on_vllm):
    """Random weights write no call of their own, so the client carries the loop: each turn sends
    a call and its output (as a client replaying its agent's calls does) and the engine writes a
    harmony answer to it. Every turn's prompt extends the one before it in vLLM's prefix cache,
    and each continuation renders only its new items."""
    c, url = client(family_on_vllm.url), family_on_vllm.url
    before = stats(url)["render_inline"]
    usages, prev = [], None
    new: list = [{"role": "user", "content": "Weather in three cities, one at a time."}]
    with c.responses.connect() as conn:
        for turn in range(20):
            resp = sdk_response(conn, model=family_on_vllm.model, input=new, previous_response_id=prev, tools=[TOOL],
                                max_output_tokens=8, temperature=0)
            assert resp.usage.output_tokens >= 1, (turn, resp)
            usages.append(resp.usage)
            prev = resp.id
            call_id = f"call_{turn}"
            new = [{"type": "function_call", "call_id": call_id, "name": "get_weather",
                    "arguments": json.dumps({"city": f"City {turn}"})},
                   {"type": "function_call_output", "call_id": call_id, "output": f"sunny, {turn} C " * 20}]
    kv = stats(url)["engine"]["kv"]
    # vLLM turns its prefix cache off for MLA (DeepSeek's attention) on a CPU without AMX tiles: the engine
    # says so, and no turn reports cached tokens it did not have
    if not kv["prefix_caching"]:
        assert "prefix caching off" in kv["pins_off_reason"] and family_on_vllm.model == TINY_DEEPSEEK_R1, kv
    for n, (a, b) in enumerate(zip(usages, usages[1:]), 1):
        # the previous prompt was in the engine's prefix cache, less at most two KV blocks of 32
        # (vLLM's hybrid cache aligns a hit for gpt-oss's full and sliding-window layers alike)
        if kv["prefix_caching"]:
            assert b.input_tokens_details.cached_tokens >= a.input_tokens - 64, (n, a, b)
        else:
            assert b.input_tokens_details.cached_tokens == 0, (n, a, b)
        assert b.input_tokens > a.input_tokens + 100, (n, a, b)  # the call and its output are in the prompt
    after = stats(url)["render_inline"]
    # continuations render incrementally (the random answers take shapes of their own: >= 90% of them)
    assert after["delta_renders"] - before["delta_renders"] >= 0.9 * 19, after
