"""Open Responses compliance: the requests of its public compliance suite (openresponses/
openresponses, src/lib/compliance-tests.ts) and `/responses/compact`, sent over HTTP, with
each result checked against the schema parts those tests validate. The suite itself is not on
a package registry, so its schema parts are transcribed here from its public openapi.json
(version 2026-04-24): ResponseResource's required fields, ItemField's item shapes, FunctionTool,
CompactResource."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.integration

_NULLABLE_STR = {"type": ["string", "null"]}
_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_PART = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}, "allOf": [
    {"if": {"properties": {"type": {"const": "input_text"}}}, "then": {"required": ["text"]}},
    {"if": {"properties": {"type": {"const": "output_text"}}}, "then": {"required": ["text", "annotations"]}},
    {"if": {"properties": {"type": {"const": "input_image"}}}, "then": {"required": ["image_url", "detail"]}},
]}
ITEM_FIELD = {"oneOf": [
    {"type": "object", "required": ["type", "id", "status", "role", "content"],
     "properties": {"type": {"const": "message"}, "id": {"type": "string"}, "status": _STATUS,
                    "role": {"enum": ["user", "assistant", "system", "developer"]},
                    "content": {"type": "array", "items": _PART}}},
    {"type": "object", "required": ["type", "id", "call_id", "name", "arguments", "status"],
     "properties": {"type": {"const": "function_call"}, "id": {"type": "string"}, "call_id": {"type": "string"},
                    "name": {"type": "string"}, "arguments": {"type": "string"}, "status": _STATUS}},
    {"type": "object", "required": ["type", "id", "call_id", "output", "status"],
     "properties": {"type": {"const": "function_call_output"}, "id": {"type": "string"},
                    "call_id": {"type": "string"}, "status": _STATUS}},
    {"type": "object", "required": ["type", "id", "summary"],
     "properties": {"type": {"const": "reasoning"}, "id": {"type": "string"}, "summary": {"type": "array"}}},
    {"type": "object", "required": ["type", "id", "encrypted_content"],
     "properties": {"type": {"const": "compaction"}, "id": {"type": "string"},
                    "encrypted_content": {"type": "string"}}},
]}
FUNCTION_TOOL = {"type": "object", "required": ["type", "name", "description", "parameters", "strict"],
                 "properties": {"type": {"const": "function"}, "name": {"type": "string"},
                                "description": _NULLABLE_STR, "parameters": {"type": ["object", "null"]},
                                "strict": {"type": ["boolean", "null"]}}}
USAGE = {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens", "input_tokens_details",
                                        "output_tokens_details"]}
RESPONSE_RESOURCE = {
    "type": "object",
    "required": ["id", "object", "created_at", "completed_at", "status", "incomplete_details", "model",
                 "previous_response_id", "instructions", "output", "error", "tools", "tool_choice", "truncation",
                 "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
                 "temperature", "reasoning", "usage", "max_output_tokens", "max_tool_calls", "store", "background",
                 "service_tier", "metadata", "safety_identifier", "prompt_cache_key"],
    "properties": {"object": {"const": "response"}, "output": {"type": "array", "items": ITEM_FIELD},
                   "tools": {"type": "array", "items": FUNCTION_TOOL}, "usage": {"anyOf": [USAGE, {"type": "null"}]},
                   "truncation": {"enum": ["auto", "disabled"]}, "parallel_tool_calls": {"type": "boolean"}},
}
COMPACT_RESOURCE = {"type": "object", "required": ["id", "object", "output", "created_at", "usage"],
                    "properties": {"object": {"const": "response.compaction"},
                                   "output": {"type": "array", "items": ITEM_FIELD}, "usage": USAGE}}

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather for a location",
                "parameters": {"type": "object", "properties": {"location": {
                    "type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
                    "required": ["location"]}}
RED_DOT = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJ"
           "RU5ErkJggg==")
# id -> (request body without model, streaming, expected output item type or None)
CASES = {
    "basic-response": ({"input": [{"type": "message", "role": "user", "content": "Say hello in exactly 3 words."}]},
                       False, "message"),
    "streaming-response": ({"input": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}]},
                           True, "message"),
    "system-prompt": ({"input": [{"type": "message", "role": "system",
                                  "content": "You are a pirate. Always respond in pirate speak."},
                                 {"type": "message", "role": "user", "content": "Say hello."}]}, False, "message"),
    "tool-calling": ({"input": [{"type": "message", "role": "user",
                                 "content": "What's the weather like in San Francisco?"}], "tools": [WEATHER_TOOL]},
                     False, "function_call"),
    "tool-calling-streaming": ({"input": [{"type": "message", "role": "user",
                                           "content": "What's the weather like in San Francisco?"}],
                                "tools": [WEATHER_TOOL]}, True, "function_call"),
    "multi-turn": ({"input": [{"type": "message", "role": "user", "content": "My name is Alice."},
                              {"type": "message", "role": "assistant",
                               "content": "Hello Alice! Nice to meet you. How can I help you today?"},
                              {"type": "message", "role": "user", "content": "What is my name?"}]}, False, "message"),
}


def test_image_input_on_a_text_only_model_is_a_clear_400(scripted_url):
    """The suite's `image-input` case: the engines here are text-only, so an image is refused in
    the API's error shape, never answered as if it had been seen (a vision model would pass)."""
    r = httpx.post(scripted_url + "/v1/responses", json={"model": "loopserve-tiny", "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
            {"type": "input_image", "image_url": RED_DOT}]}]}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "The model 'loopserve-tiny' does not support image input; send text only.",
                                 "type": "invalid_request_error", "param": "input[0].content[1]",
                                 "code": "unsupported_value"}


def sse_final_response(text: str) -> tuple[dict, list[str]]:
    events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()
              and line[5:].strip() != "[DONE]"]
    return events[-1]["response"], [e["type"] for e in events]


@pytest.mark.parametrize("case", sorted(CASES))
def test_compliance_request_passes_the_schema(scripted_url, case):
    body, streaming, expected = CASES[case]
    r = httpx.post(scripted_url + "/v1/responses", json={"model": "loopserve-tiny", **body, "stream": streaming},
                   headers={"authorization": "Bearer sk-test"}, timeout=60)
    assert r.status_code == 200, r.text
    if streaming:
        response, kinds = sse_final_response(r.text)
        if expected == "function_call":
            assert {"response.output_item.added", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done"} <= set(kinds)
    else:
        response = r.json()
    jsonschema.validate(response, RESPONSE_RESOURCE)
    assert any(item["type"] == expected for item in response["output"])
    if expected == "message":
        assert response["status"] == "completed"


def test_compact_response_passes_the_schema(scripted_url):
    history = [{"type": "message", "role": "user", "content": f"Step {n}: look at file {n}."} for n in range(6)]
    history[3:3] = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                    {"type": "message", "role": "assistant", "content": "It is sunny."},
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and then"}]}]
    r = httpx.post(scripted_url + "/v1/responses/compact", json={"model": "loopserve-tiny", "input": history},
                   headers={"authorization": "Bearer sk-test"}, timeout=60)
    assert r.status_code == 200, r.text
    compacted = r.json()
    jsonschema.validate(compacted, COMPACT_RESOURCE)
    # the user messages verbatim, then exactly one compaction item for the rest
    kinds = [item["type"] for item in compacted["output"]]
    assert kinds == ["message"] * 7 + ["compaction"]
    users = [item for item in history if item.get("role") == "user"]
    assert [(m["role"], m["content"][0]["text"]) for m in compacted["output"][:7]] == [
        ("user", u["content"] if isinstance(u["content"], str) else u["content"][0]["text"]) for u in users]
    # the compacted window continues; the same item altered is a 400 naming it, on HTTP and WebSocket
    item = compacted["output"][-1]
    follow = httpx.post(scripted_url + "/v1/responses", json={
        "model": "loopserve-tiny", "input": compacted["output"] + [{"role": "user", "content": "go on"}]},
        headers={"authorization": "Bearer sk-test"}, timeout=60)
    assert follow.status_code == 200 and follow.json()["status"] == "completed", follow.text
    altered = {**item, "encrypted_content": item["encrypted_content"][:-4] + "AAAA"}
    bad = httpx.post(scripted_url + "/v1/responses", json={"model": "loopserve-tiny", "input": [altered]},
                     headers={"authorization": "Bearer sk-test"}, timeout=60)
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_encrypted_content" and item["id"] in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "input[0].encrypted_content"
