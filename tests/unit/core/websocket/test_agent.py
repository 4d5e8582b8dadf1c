"""Beta multi-agent responses and `response.inject` on the WebSocket session (asyncio, a recording send; no socket):
one response waits for its client tool calls' outputs, takes them injected (all or none), and
generates again in the same response; what cannot be committed is refused or returned."""

import asyncio

from openai.types.beta.beta_responses_server_event import BetaResponsesServerEvent
from pydantic import TypeAdapter

from cluster.core.websocket.agent import BETA
from tests.support.harness import InProcessStack
from tests.support.peer import TOOLS, Peer, of_type, wait_for

BETA_EVENT = TypeAdapter(BetaResponsesServerEvent)
AGENT = {"enabled": True, "max_concurrent_subagents": 3}


async def waiting_agent(tokenizer) -> tuple[Peer, str, dict]:
    """A multi-agent response that called a client tool and now waits for its output."""
    stack = InProcessStack(tokenizer, tokens_per_second=500)
    p = Peer(stack, betas={BETA})
    await p.frame({"type": "response.create", "input": "read the file", "tools": TOOLS, "store": False,
                   "multi_agent": AGENT})
    await wait_for(p, "response.output_item.done")
    rid = of_type(p, "response.created")[0]["response"]["id"]
    [call] = [e["item"] for e in of_type(p, "response.output_item.done")]
    return p, rid, call


async def test_a_multi_agent_response_takes_injected_tool_outputs_and_goes_on(tokenizer):
    p, rid, call = await waiting_agent(tokenizer)
    assert call["type"] == "function_call"
    await asyncio.sleep(0.1)
    assert not p.terminals()  # it waits for the tool output instead of ending
    # Bad input is refused whole (an unknown call id in the batch): nothing is committed.
    await p.frame({"type": "response.inject", "response_id": rid, "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "x = 1"},
        {"type": "function_call_output", "call_id": "call_unknown", "output": "?"}]})
    await wait_for(p, "error")
    assert of_type(p, "error")[0]["error"]["param"] == "input[1].call_id" and not p.terminals()
    await p.frame({"type": "response.inject", "response_id": rid, "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "x = 1"}]})
    await p.idle()
    [created] = of_type(p, "response.inject.created")
    assert created["response_id"] == rid
    BETA_EVENT.validate_python(created)
    [done] = p.terminals()
    assert done["id"] == rid and done["status"] == "completed"
    assert [o["type"] for o in done["output"]] == ["function_call", "function_call_output", "message"]
    assert done["output"][1]["call_id"] == call["call_id"] and done["output"][1]["output"] == "x = 1"
    assert len(p.stack.engine_requests) == 2  # two engine calls, one response
    # The second call was a continuation: only the new tail travelled to the engine.
    assert len(p.stack.engine_requests[1].prompt_token_ids) < done["usage"]["input_tokens"] // 4
    # One event stream: sequence numbers run on across the engine calls.
    end = p.sent.index(of_type(p, "response.completed")[0])
    own = [e for e in p.sent[:end + 1] if e["type"].startswith("response.") and e["type"] != "response.inject.created"]
    assert [e["sequence_number"] for e in own] == list(range(len(own)))
    # The response continues like any other: its context holds the whole loop.
    await p.frame({"type": "response.create", "input": "thanks", "previous_response_id": rid, "store": False})
    await p.idle()
    assert p.terminals()[-1]["status"] == "completed"
    # Late or misdirected injects come back with their input.
    late = [{"type": "function_call_output", "call_id": call["call_id"], "output": "again"}]
    await p.frame({"type": "response.inject", "response_id": rid, "input": late})
    await p.frame({"type": "response.inject", "response_id": "resp_nope", "input": late})
    await p.idle()
    failed = of_type(p, "response.inject.failed")
    assert [f["error"]["code"] for f in failed] == ["response_already_completed", "response_not_found"]
    assert all(f["input"] == late for f in failed)
    for ev in failed:
        BETA_EVENT.validate_python(ev)
    await p.session.shutdown()


async def test_multi_agent_needs_the_beta_header_and_stops_waiting_in_time(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=500)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "read the file", "tools": TOOLS, "multi_agent": AGENT})
    await p.idle()
    assert p.sent[-1]["type"] == "error" and p.sent[-1]["error"]["param"] == "multi_agent"
    await p.session.shutdown()
    p = Peer(stack, betas={BETA, "responses_websockets=2026-02-06"}, agent_wait_seconds=0.3)
    await p.frame({"type": "response.create", "input": "read the file", "tools": TOOLS, "store": False,
                   "multi_agent": AGENT})
    await p.idle()
    [done] = p.terminals()  # nobody injected: it ends as it stands, the call left for a continuation
    assert done["status"] == "completed" and [o["type"] for o in done["output"]] == ["function_call"]
    await p.frame({"type": "response.create", "previous_response_id": done["id"], "tools": TOOLS, "store": False,
                   "input": [{"type": "function_call_output", "call_id": done["output"][0]["call_id"], "output": "ok"}]})
    await p.idle()
    assert p.terminals()[-1]["status"] == "completed"
    await p.session.shutdown()


async def test_injected_output_a_connection_holds_is_bounded_in_bytes(tokenizer, monkeypatch):
    """Outputs waiting in the inbox count against a per-connection byte bound."""
    from cluster.core.websocket import agent
    monkeypatch.setattr(agent, "MAX_INJECTED_BYTES", 4096)
    p, rid, call = await waiting_agent(tokenizer)
    await p.frame({"type": "response.inject", "response_id": rid, "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "x" * 5000}]})
    await wait_for(p, "error")
    [err] = of_type(p, "error")
    assert err["error"]["code"] == "inject_limit_reached" and not p.terminals()
    # nothing was committed: the same call takes a smaller output, and the response goes on
    await p.frame({"type": "response.inject", "response_id": rid, "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "x = 1"}]})
    await p.idle()
    [done] = p.terminals()
    assert done["status"] == "completed" and done["output"][1]["output"] == "x = 1"
