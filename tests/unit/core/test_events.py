"""Event sequences of docs/protocol.md, checked against the openai SDK's own models."""

import typing

from openai.types.responses import Response, ResponseStreamEvent

from cluster.core.events import EventAssembler, build_response, usage_object
from cluster.protocol.errors import ApiError
from cluster.protocol.requests import parse_request

# The SDK's event union, by `type` literal (it is not a pydantic-discriminated union).
EVENT_MODELS = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def assembler(**body):
    req = parse_request({"model": "m", "input": "hi", **body})
    return EventAssembler(build_response(response_id="resp_1", model="m", request=req, previous_response_id=None))


def check(events):
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT_MODELS[e["type"]].model_validate(e)  # the SDK's own model accepts every event
    return [e["type"] for e in events]


def test_text_answer_sequence():
    a = assembler()
    evs = a.start() + a.text("Hel") + a.text("lo") + a.finish(usage_object(10, 4, 2))
    assert check(evs) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    assert evs[2]["item"]["content"] == [] and evs[2]["item"]["status"] == "in_progress"
    assert evs[3]["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    assert evs[6]["text"] == "Hello" and evs[6]["logprobs"] == []
    final = evs[-1]["response"]
    Response.model_validate(final)
    assert final["status"] == "completed" and final["completed_at"] is not None
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 4
    assert final["usage"]["total_tokens"] == 12


def test_response_has_every_field_of_protocol_section_3():
    a = assembler(metadata={"k": "v"}, store=False)
    resp = a.start()[0]["response"]
    for field in (
        "id object created_at completed_at status incomplete_details model previous_response_id instructions "
        "output error tools tool_choice truncation parallel_tool_calls text top_p temperature presence_penalty "
        "frequency_penalty top_logprobs reasoning usage max_output_tokens max_tool_calls store background "
        "service_tier metadata safety_identifier prompt_cache_key"
    ).split():
        assert field in resp, field
    assert resp["store"] is False and resp["metadata"] == {"k": "v"} and resp["id"].startswith("resp_")


def test_function_call_sequence_after_text():
    a = assembler()
    evs = a.start() + a.text("Let me look.") + a.tool_call("read", '{"path": "a"}') + a.finish(usage_object(1, 0, 1))
    types = check(evs)
    assert types[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    i = types.index("response.function_call_arguments.delta")
    assert types[i - 1] == "response.output_item.added" and evs[i - 1]["item"]["arguments"] == ""
    assert types[i - 2] == "response.output_item.done"  # the message closed first
    assert evs[i + 1]["arguments"] == '{"path": "a"}'
    item = evs[-1]["response"]["output"][1]
    assert item["type"] == "function_call" and item["call_id"].startswith("call_") and item["status"] == "completed"
    assert evs[i]["output_index"] == 1


def test_reasoning_sequence():
    a = assembler()
    evs = a.start() + a.reasoning("think") + a.text("answer") + a.finish(usage_object(1, 0, 2))
    types = check(evs)
    assert types[2:6] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
    ]
    assert evs[-1]["response"]["output"][0]["type"] == "reasoning"


def test_incomplete_and_failed_terminals():
    a = assembler()
    evs = a.start() + a.text("x") + a.finish(usage_object(1, 0, 1), incomplete_reason="max_output_tokens")
    check(evs)
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    b = assembler()
    evs = b.start() + b.fail(ApiError(500, "boom", code="server_error"))
    assert [e["type"] for e in evs][-2:] == ["error", "response.failed"]
    err = evs[-2]
    assert err["code"] == "server_error" and err["error"]["type"] == "server_error" and err["message"] == "boom"
    failed = evs[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "boom" and failed["usage"] is not None
    Response.model_validate(failed)


def test_stream_id_is_carried_on_every_event():
    req = parse_request({"input": "x"})
    a = EventAssembler(build_response(response_id="r", model="m", request=req, previous_response_id=None), stream_id="lane-1")
    evs = a.start() + a.text("x") + a.finish(usage_object(1, 0, 1))
    assert all(e["stream_id"] == "lane-1" for e in evs)


def test_sent_events_are_snapshots():
    a = assembler()
    created = a.start()[0]
    a.text("x")
    a.finish(usage_object(1, 0, 1))
    assert created["response"]["output"] == [] and created["response"]["status"] == "in_progress"


def test_function_call_items_carry_no_content_field():
    a = assembler()
    evs = a.start() + a.tool_call("f", "{}") + a.finish(usage_object(1, 0, 1))
    assert "content" not in evs[-1]["response"]["output"][0]


def test_a_response_waiting_for_engine_kv_is_queued_then_in_progress_again():
    a = assembler()
    evs = a.start() + a.queued() + a.resumed() + a.resumed() + a.text("ok") + a.finish(usage_object(5, 0, 1))
    types = check(evs)
    assert types[:4] == ["response.created", "response.in_progress", "response.queued", "response.in_progress"]
    assert types.count("response.in_progress") == 2  # resumed only once
    assert evs[2]["response"]["status"] == "queued" and evs[3]["response"]["status"] == "in_progress"
    assert evs[-1]["response"]["status"] == "completed"


def test_a_response_reports_the_sampling_the_engine_used():
    """No `temperature` in the request: the model's own default (SmolLM2's generation_config says
    0.0, greedy) is what the engine used, so that is what the response says; a request's own wins."""
    greedy = {"temperature": 0.0}
    unset = build_response(response_id="r", model="m", request=parse_request({"input": "x"}),
                           previous_response_id=None, sampling=greedy)
    assert unset["temperature"] == 0.0 and unset["top_p"] == 1.0
    asked = build_response(response_id="r", model="m", request=parse_request({"input": "x", "temperature": 0.7}),
                           previous_response_id=None, sampling=greedy)
    assert asked["temperature"] == 0.7
    assert build_response(response_id="r", model="m", request=parse_request({"input": "x"}),
                          previous_response_id=None)["temperature"] == 1.0  # no model default: vLLM's 1.0
