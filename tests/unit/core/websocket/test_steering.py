"""`response.steer` on the WebSocket session (asyncio, a recording send; no socket) (docs/protocol.md): accepted / failed /
pending, the steered response and its automatic successor, input returned when it cannot be
committed. Events are checked against the openai SDK's server-event types."""

import json

import pytest
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter

from cluster.config import ScriptedEngineConfig
from cluster.core.websocket import steering
from tests.support.harness import InProcessStack
from tests.support.peer import TOOLS, Peer, of_type, wait_for

SERVER_EVENT = TypeAdapter(ResponsesServerEvent)
STEER_TEXT = "Actually, answer in French."
STEERED_ANSWER = "Bien sur, en francais."
# A tool call, then more generated text: a steer can arrive after the call went out.
CALL_THEN_TEXT = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
                  + " and then some" * 8)


def steered_stack(tokenizer, **kw):
    # The successor's prompt holds the steering text only if it was committed to its input.
    return InProcessStack(tokenizer, tokens_per_second=50,
                          answer_rules=[{"contains": STEER_TEXT, "text": STEERED_ANSWER},
                                        {"contains": "read the file", "text": CALL_THEN_TEXT}], **kw)


async def test_a_steer_stops_the_response_and_its_successor_commits_the_input(tokenizer):
    p = Peer(steered_stack(tokenizer))
    await p.frame({"type": "response.create", "input": "tell me a long story", "store": False, "temperature": 0.5,
                   "instructions": "Be brief."})
    await wait_for(p, "response.output_text.delta", 3)
    rid = of_type(p, "response.created")[0]["response"]["id"]
    await p.frame({"type": "response.steer", "previous_response_id": rid, "input": STEER_TEXT})
    await p.idle()
    [accepted] = of_type(p, "response.steer.accepted")
    assert accepted["steer"]["previous_response_id"] == rid and accepted["steer"]["id"].startswith("steer_")
    steered, successor = p.terminals()
    assert steered["id"] == rid and steered["status"] == "incomplete"
    assert steered["incomplete_details"] == {"reason": "steered"}
    # It keeps the output that went out, closed where it stopped.
    [message] = steered["output"]
    said, full = message["content"][0]["text"], ScriptedEngineConfig().answer_text
    assert message["status"] == "incomplete" and said and full.startswith(said) and len(said) < len(full)
    # The successor: automatic, continues the steered response with the steering input, inherits its settings.
    created = of_type(p, "response.created")
    assert len(created) == 2 and created[1]["response"]["previous_response_id"] == rid
    assert successor["status"] == "completed" and successor["output"][0]["content"][0]["text"] == STEERED_ANSWER
    assert successor["temperature"] == 0.5 and successor["instructions"] == "Be brief." and successor["store"] is False
    # The accepted event precedes the successor's response.created (its commit point).
    assert p.sent.index(accepted) < p.sent.index(created[1])
    for ev in p.sent:
        SERVER_EVENT.validate_python(ev)
    await p.session.shutdown()


async def test_a_steer_for_a_response_owing_tool_output_is_pending_until_the_explicit_create(tokenizer):
    p = Peer(steered_stack(tokenizer, max_output_tokens=400))
    await p.frame({"type": "response.create", "input": "read the file", "tools": TOOLS, "store": False,
                   "max_output_tokens": 400})
    await wait_for(p, "response.output_item.added")
    rid = of_type(p, "response.created")[0]["response"]["id"]
    await p.frame({"type": "response.steer", "previous_response_id": rid,
                   "input": [{"role": "user", "content": [{"type": "input_text", "text": STEER_TEXT}]}]})
    await p.idle()
    [done] = p.terminals()
    assert done["status"] == "completed"  # not stopped: a tool call is owed to it
    [call, _] = done["output"]
    [pending] = of_type(p, "response.steer.pending")
    assert p.sent.index(pending) > p.sent.index(of_type(p, "response.completed")[0])
    assert pending["reason"] == "waiting_for_required_input"
    assert pending["required_input"] == [{"type": "function_call_output", "call_id": call["call_id"],
                                          "name": "read_file"}]
    assert len(of_type(p, "response.created")) == 1  # no automatic successor
    # A second steer for the waiting response is accepted and reported pending at once.
    await p.frame({"type": "response.steer", "previous_response_id": rid, "input": "and be polite"})
    await p.idle()
    assert len(of_type(p, "response.steer.accepted")) == 2 and len(of_type(p, "response.steer.pending")) == 2
    # The explicit continuation: steering input first (in submission order), then the tool output.
    await p.frame({"type": "response.create", "previous_response_id": rid, "tools": TOOLS, "store": False,
                   "max_output_tokens": 400, "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "x = 1"}]})
    await p.idle()
    final = p.terminals()[-1]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == STEERED_ANSWER
    state = p.session.cache.get(final["id"])
    new = state.items[state.input_start:state.output_start]  # the input its response.created committed
    assert [i.get("content") if i["type"] == "message" else i["type"] for i in new] == [
        [{"type": "input_text", "text": STEER_TEXT}], "and be polite", "function_call_output"]
    for ev in p.sent:
        SERVER_EVENT.validate_python(ev)
    await p.session.shutdown()


@pytest.mark.parametrize("event, code", [
    ({"previous_response_id": "resp_x", "input": "hi", "stream_id": "a"}, "invalid_input"),
    ({"input": "hi"}, "invalid_input"),
    ({"previous_response_id": "resp_x", "input": []}, "invalid_input"),
    ({"previous_response_id": "resp_x", "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "invalid_input"),
    ({"previous_response_id": "resp_x", "input": [{"role": "assistant", "content": "hi"}]}, "invalid_input"),
    ({"previous_response_id": "resp_x", "input": "hi"}, "response_not_found"),
])
async def test_a_steer_that_cannot_apply_fails_returning_its_input(tokenizer, event, code):
    p = Peer(steered_stack(tokenizer))
    await p.frame({"type": "response.steer", **event})
    await p.frame({"type": "response.create", "input": "hi", "store": False})
    await p.idle()
    failed = p.sent[0]
    assert failed["type"] == "response.steer.failed" and failed["error"]["code"] == code
    assert failed["steer"]["input"] == event.get("input") and "id" not in failed["steer"]
    if code != "invalid_input" or "stream_id" in event:  # (an invalid input cannot match the SDK's type)
        SERVER_EVENT.validate_python(failed)
    assert p.terminals()[0]["status"] == "completed"  # the socket keeps working
    await p.session.shutdown()


async def test_steering_a_finished_response_or_a_warm_up_fails(tokenizer):
    p = Peer(steered_stack(tokenizer, max_output_tokens=4))
    await p.frame({"type": "response.create", "input": "hi", "store": False})
    await p.idle()
    rid = p.terminals()[0]["id"]
    await p.frame({"type": "response.steer", "previous_response_id": rid, "input": STEER_TEXT})
    await p.idle()
    assert of_type(p, "response.steer.failed")[-1]["error"]["code"] == "response_already_completed"
    assert len(of_type(p, "response.created")) == 1
    await p.session.shutdown()


async def test_too_many_steers_and_a_failed_successor_return_the_input(tokenizer):
    p = Peer(steered_stack(tokenizer, max_model_len=400))
    await p.frame({"type": "response.create", "input": "tell me a long story", "store": False,
                   "max_output_tokens": 64})
    await wait_for(p, "response.output_text.delta")
    rid = of_type(p, "response.created")[0]["response"]["id"]
    # Queued in one go (the frames are handled before the response stops): 8 fit, the 9th does not.
    big = "word " * 120  # the successor's prompt then exceeds the 400-token context
    for n in range(steering.MAX_STEERS_PER_RESPONSE + 1):  # nothing between them yields to the response
        await p.session.on_frame(json.dumps({"type": "response.steer", "previous_response_id": rid,
                                             "input": f"{n} {big}"}))
    await p.idle()
    assert len(of_type(p, "response.steer.accepted")) == steering.MAX_STEERS_PER_RESPONSE
    failed = of_type(p, "response.steer.failed")
    assert failed[0]["error"]["code"] == "too_many_pending_steers" and failed[0]["steer"]["input"].startswith("8 ")
    # The successor could not be created (context too long): every accepted input comes back with its id.
    returned = failed[1:]
    assert [f["error"]["code"] for f in returned] == ["successor_creation_failed"] * steering.MAX_STEERS_PER_RESPONSE
    assert [f["steer"]["id"] for f in returned] == [a["steer"]["id"] for a in of_type(p, "response.steer.accepted")]
    assert not of_type(p, "error")
    await p.frame({"type": "response.create", "input": "hi", "store": False})
    await p.idle()
    assert p.terminals()[-1]["status"] == "completed"
    await p.session.shutdown()
