"""HTTP + SSE against the real Serve app, with the real openai SDK."""

import json

import httpx
import pytest

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def test_models_and_health(scripted_url, client_for):
    ids = [m.id for m in client_for(scripted_url).models.list()]
    assert ids == ["loopserve-tiny"]
    assert httpx.get(scripted_url + "/health", timeout=10).json() == {"status": "ok"}


def test_create_tool_call_then_continue_over_http(scripted_url, client_for):
    client = client_for(scripted_url)
    first = client.responses.create(model="loopserve-tiny", input="Read the readme please", tools=TOOLS)
    assert first.status == "completed" and first.object == "response"
    call = first.output[0]
    assert call.type == "function_call" and call.name == "read_file"
    assert json.loads(call.arguments) == {"path": "README.md"}
    second = client.responses.create(
        model="loopserve-tiny", previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "# loopserve\n" * 40}],
    )
    assert second.status == "completed"
    assert second.previous_response_id == first.id
    assert second.output_text.startswith("I looked at the files")
    # The continuation hit the in-memory cache: the engine did not recompute the prefix.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert client.responses.retrieve(second.id).id == second.id


def test_streaming_with_the_sdk(scripted_url, client_for):
    client = client_for(scripted_url)
    types = []
    with client.responses.stream(model="loopserve-tiny", input="hello") as stream:
        for event in stream:
            types.append(event.type)
        final = stream.get_final_response()
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types.count("response.output_text.delta") > 3
    assert types[-1] == "response.completed"
    assert final.output_text.startswith("I looked")
    assert final.usage.output_tokens > 0


def test_sse_framing_and_done_marker(scripted_url):
    with httpx.stream("POST", scripted_url + "/v1/responses", timeout=30,
                      json={"model": "loopserve-tiny", "input": "hi", "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    blocks = [b for b in body.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    seqs = []
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        seqs.append(data["sequence_number"])
    assert seqs == list(range(len(seqs)))


@pytest.mark.parametrize(
    "body,status,code,param",
    [
        ({"model": "loopserve-tiny", "input": "x", "previous_response_id": "resp_unknown"}, 400,
         "previous_response_not_found", "previous_response_id"),
        ({"model": "gpt-unknown", "input": "x"}, 404, "model_not_found", "model"),
        ({"model": "loopserve-tiny", "input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
         400, "invalid_value", "input"),
        ({"model": "loopserve-tiny", "input": [{"type": "nonsense"}]}, 400, "invalid_value", "input[0].type"),
        ({"model": "loopserve-tiny", "input": "x", "temperature": 9}, 400, "invalid_value", "temperature"),
    ],
)
def test_bad_requests_get_the_api_error_shape(scripted_url, body, status, code, param):
    r = httpx.post(scripted_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["type"] and err["message"]


def test_unparseable_body_and_unknown_route(scripted_url):
    r = httpx.post(scripted_url + "/v1/responses", content=b"{nope", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(scripted_url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    # and the server keeps working
    assert httpx.get(scripted_url + "/health", timeout=10).status_code == 200


def test_store_false_responses_cannot_be_continued_over_http(scripted_url, client_for):
    from openai import BadRequestError

    client = client_for(scripted_url)
    first = client.responses.create(model="loopserve-tiny", input="hi", store=False)
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model="loopserve-tiny", input="more", previous_response_id=first.id)
    assert e.value.body["code"] == "previous_response_not_found"
