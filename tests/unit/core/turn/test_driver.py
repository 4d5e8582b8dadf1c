"""The turn driver over the real renderer and the scripted engine, no Ray."""

import asyncio
import json
from contextlib import aclosing

import pytest

from cluster.core.turn.cache import SessionCache
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request
from tests.support.harness import InProcessStack

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture
def stack(tokenizer):
    return InProcessStack(tokenizer)


async def run(stack, cache, body, **kw):
    return [ev async for ev in stack.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s1", **kw)))]


def terminal(events):
    return events[-1]["response"]


async def test_tool_loop_renders_only_new_items_and_reports_cached_tokens(stack):
    cache = SessionCache()
    evs = await run(stack, cache, {"model": "loopserve-tiny", "input": "read the readme", "tools": TOOLS,
                                    "instructions": "be brief"})
    resp = terminal(evs)
    assert resp["status"] == "completed"
    call = resp["output"][0]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"path": "README.md"}
    prev = resp["id"]
    for turn in range(10):
        body = {"model": "loopserve-tiny", "previous_response_id": prev, "tools": TOOLS, "instructions": "be brief",
                "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "x " * 200},
                          {"type": "message", "role": "user", "content": f"now turn {turn}"}]}
        resp = terminal(await run(stack, cache, body))
        assert resp["status"] == "completed", resp
        assert resp["previous_response_id"] == prev
        assert resp["usage"]["input_tokens_details"]["cached_tokens"] > 0
        assert resp["usage"]["input_tokens_details"]["cached_tokens"] < resp["usage"]["input_tokens"]
        call = resp["output"][0]
        prev = resp["id"]
    modes = [j.mode for j in stack.render_jobs]
    assert modes == ["full"] + ["delta"] * 10
    assert stack.mismatches == 0
    # each delta job carries only the anchor + new items, never the history
    assert all(len(j.new_items) + len(j.anchor_items) <= 4 for j in stack.render_jobs[1:])


async def test_unknown_previous_response_is_not_found(stack):
    with pytest.raises(ApiError) as e:
        await run(stack, SessionCache(), {"input": "x", "previous_response_id": "resp_nope"})
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    assert e.value.message == "Previous response with id 'resp_nope' not found."


async def test_failed_continuation_evicts_its_parent(stack):
    cache = SessionCache()
    first = terminal(await run(stack, cache, {"input": "read it", "tools": TOOLS}))
    with pytest.raises(ApiError, match="No tool output found"):
        await run(stack, cache, {"previous_response_id": first["id"], "input": "ignore the call", "tools": TOOLS})
    assert first["id"] not in cache
    with pytest.raises(ApiError) as e:
        await run(stack, cache, {"previous_response_id": first["id"], "input": "again"})
    assert e.value.code == "previous_response_not_found"


async def test_engine_failure_mid_turn_fails_the_response_and_evicts_parent(stack):
    cache = SessionCache()
    first = terminal(await run(stack, cache, {"input": "hello"}))
    stack.fail_engine = True
    evs = await run(stack, cache, {"previous_response_id": first["id"], "input": "more"})
    assert [e["type"] for e in evs][-2:] == ["error", "response.failed"]
    assert first["id"] not in cache


async def test_warmup_then_chain(stack):
    cache = SessionCache()
    evs = await run(stack, cache, {"input": "start", "tools": TOOLS, "generate": False})
    assert [e["type"] for e in evs] == ["response.created", "response.in_progress", "response.completed"]
    warm = terminal(evs)
    assert warm["output"] == [] and warm["usage"]["output_tokens"] == 0
    resp = terminal(await run(stack, cache, {"previous_response_id": warm["id"], "input": [], "tools": TOOLS}))
    assert resp["output"][0]["type"] == "function_call"
    assert [j.mode for j in stack.render_jobs] == ["full", "delta"]
    assert list(stack.render_jobs[1].new_items) == []


async def test_changed_instructions_force_a_full_render_and_are_not_carried_over(stack):
    cache = SessionCache()
    first = terminal(await run(stack, cache, {"input": "hi", "instructions": "A"}))
    second = terminal(await run(stack, cache, {"input": "hi", "previous_response_id": first["id"]}))
    assert second["instructions"] is None
    assert [j.mode for j in stack.render_jobs] == ["full", "full"]


async def test_context_length_exceeded(tokenizer):
    stack = InProcessStack(tokenizer, max_model_len=64)
    with pytest.raises(ApiError) as e:
        await run(stack, SessionCache(), {"input": "word " * 200})
    assert e.value.code == "context_length_exceeded"


async def test_instructions_and_tools_that_cannot_fit_are_refused_before_anything_is_rendered(tokenizer):
    stack = InProcessStack(tokenizer, max_model_len=64)
    with pytest.raises(ApiError) as e:
        await run(stack, SessionCache(), {"input": "hi", "instructions": "word " * 200_000})
    assert e.value.code == "context_length_exceeded" and "at least" in e.value.message
    huge = [{**TOOLS[0], "description": "x" * 2_000_000}]
    with pytest.raises(ApiError) as e:
        await run(stack, SessionCache(), {"input": "hi", "tools": huge})
    assert e.value.code == "context_length_exceeded" and e.value.param == "tools"
    assert stack.render_jobs == []  # neither reached the renderer or the tokenizer
    assert terminal(await run(stack, SessionCache(), {"input": "hi", "instructions": "be brief"}))["status"] == "completed"
    # A tool the model is not offered is never rendered: bounded as echo (1 MiB), not by the context.
    echoed = [{"type": "web_search", "x": "A" * 900_000}]
    assert terminal(await run(stack, SessionCache(), {"input": "hi", "tools": echoed}))["status"] == "completed"


async def test_wrong_model_is_model_not_found(stack):
    with pytest.raises(ApiError) as e:
        await run(stack, SessionCache(), {"model": "gpt-99", "input": "x"})
    assert e.value.code == "model_not_found"


async def test_max_output_tokens_makes_the_response_incomplete(stack):
    resp = terminal(await run(stack, SessionCache(), {"input": "hi", "max_output_tokens": 2}))
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["output_tokens"] == 2


async def test_state_is_cached_before_the_terminal_event(stack):
    cache = SessionCache()
    seen = {}
    async for ev in stack.driver.run(TurnRequest(parse_request({"input": "hi"}), TurnScope(cache, session_key="s"))):
        if ev["type"] == "response.completed":
            seen["cached"] = ev["response"]["id"] in cache
    assert seen["cached"] is True


async def test_cancelling_a_turn_stops_the_engine(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=20)

    async def consume():
        async for _ in stack.driver.run(TurnRequest(parse_request({"input": "hi"}), TurnScope(SessionCache(), session_key="s"))):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stack.engine.stats.aborted == 1
    assert stack.engine.stats.output_tokens < 15


@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_a_turn_ends_at_the_engines_last_word_not_at_the_end_of_its_stream(tokenizer, transport):
    """EngineDone is the last thing an engine says: the terminal event goes out then, not after
    the engine replica's own work behind it (its digests, its KV budget) and its stream's end."""
    from tests.support.peer import Peer

    stack = InProcessStack(tokenizer)
    engine = stack.driver.services.engine
    closed = []

    async def slow_to_end(req, stop=None):
        try:
            async with aclosing(engine(req, stop)) as chunks:
                async for chunk in chunks:
                    yield chunk
            await asyncio.sleep(30)
        finally:
            closed.append(req.request_id)

    stack.driver.services.engine = slow_to_end
    body = {"model": "loopserve-tiny", "input": "hi", "store": False}
    if transport == "websocket":
        p = Peer(stack)
        await p.frame({"type": "response.create", **body})
        await p.idle()  # bounded: 10 s
        assert p.types()[-1] == "response.completed"
    else:
        response = await asyncio.wait_for(stack.run(body), 10)
        assert response["status"] == "completed"
    assert len(closed) == 1  # and the stream was closed, not left to run


@pytest.mark.parametrize("transport,stream,streamed", [("http", None, False), ("http", False, False),
                                                       ("http", True, True), ("websocket", None, True)])
async def test_the_engine_is_told_whether_the_client_reads_the_output_as_it_comes(tokenizer, transport, stream,
                                                                                 streamed):
    """A plain HTTP response is one answer at the end: the engine may gather its pieces (vLLM then sends
    only its first and last: no per-token wakeups). A WebSocket or `stream: true` reads every piece."""
    stack = InProcessStack(tokenizer)
    engine = stack.driver.services.engine
    seen = []

    def recording(req, stop=None):
        seen.append(req.streamed)
        return engine(req, stop)

    stack.driver.services.engine = recording
    body = {"model": "loopserve-tiny", "input": "hi", "store": False, **({} if stream is None else {"stream": stream})}
    events = await run(stack, SessionCache(), body, transport=transport)
    assert terminal(events)["status"] == "completed" and seen == [streamed]


@pytest.mark.parametrize("transport,store,told", [("websocket", False, True), ("websocket", True, False),
                                                 ("websocket", None, False), ("http", False, False)])
async def test_the_engine_is_told_whether_a_socket_s_close_will_tell_the_session_s_end(tokenizer, transport, store,
                                                                                     told):
    """A `store: false` socket's close releases the session's KV: its length need not tell its end.
    A stored turn's socket (a client reconnecting each turn) and HTTP end without a word."""
    stack = InProcessStack(tokenizer)
    engine = stack.driver.services.engine
    seen = []

    def recording(req, stop=None):
        seen.append((req.expect_back, req.close_tells_end))
        return engine(req, stop)

    stack.driver.services.engine = recording
    body = {"model": "loopserve-tiny", "input": "hi", **({} if store is None else {"store": store})}
    events = await run(stack, SessionCache(), body, transport=transport)
    assert terminal(events)["status"] == "completed" and seen == [(transport == "websocket", told)]


async def test_deepseek_r1s_tool_loop_is_incremental_and_every_engine_prompt_is_its_full_render():
    """DeepSeek-R1's template closes the last tool outputs with a tail that a following message renders
    otherwise: each turn takes that tail back (a few tokens) and sends only the new ones, and the prompt the
    engine resolves from its cached base plus the tail is the full render of the conversation, every turn."""
    from transformers import AutoTokenizer

    from cluster.models.builtin import ensure_builtin
    from cluster.models.names import TINY_DEEPSEEK_R1

    pytest.importorskip("vllm")
    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin(TINY_DEEPSEEK_R1, weights=False))
    stack = InProcessStack(tokenizer, tool_parser="deepseek_v3", thinks=True, calls_per_turn=2,
                           user_marker="<｜User｜>", tool_result_marker="<｜tool▁outputs▁end｜>")
    tools = TOOLS + [{"type": "function", "name": "shell", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}}}]
    sent, resolved = [], []  # what the turn sent the engine replica, and the prompt the replica made of it
    resolve = stack.prompts.resolve
    stack.prompts.resolve = lambda req: sent.append(req) or resolved.append(resolve(req)) or resolved[-1]
    items = [{"type": "message", "role": "user", "content": "fix the bug"}]
    resp, prev = await stack.run({"model": "loopserve-tiny", "input": items, "tools": tools}), None
    call_turns = tails = 0
    for turn in range(12):
        assert resp["status"] == "completed", resp
        full = stack.renderer.full(items, None, stack.render_jobs[-1].tools).assemble(None)[1]
        assert list(resolved[-1].prompt_token_ids) == list(full), f"turn {turn}: the engine's prompt is not the render"
        items = items + resp["output"]
        calls = [o for o in resp["output"] if o["type"] == "function_call"]
        new = [{"type": "function_call_output", "call_id": c["call_id"], "output": f"out {turn} " * (50 * turn + 40)}
               for c in calls] or [{"type": "message", "role": "user", "content": f"next, step {turn}"}]
        if turn % 3 == 2 and calls:
            new.append({"type": "message", "role": "user", "content": "and the tests"})
        assert len(calls) in (0, 2), resp["output"]
        call_turns += bool(calls)
        items, prev = items + new, resp["id"]
        resp = await stack.run({"model": "loopserve-tiny", "previous_response_id": prev, "input": new, "tools": tools})
        tails += sent[-1].is_tail
    assert [j.mode for j in stack.render_jobs] == ["full"] + ["delta"] * 12
    assert stack.mismatches == 0 and call_turns >= 6
    assert all(r is not None for r in resolved) and tails == 12  # every later turn sent its tail only
    assert sum(len(r.prompt_token_ids) for r in sent[-6:]) < sum(len(r.prompt_token_ids) for r in resolved[-6:]) / 3
