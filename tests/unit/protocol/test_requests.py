"""Request validation (`protocol/requests.py`): bodies parsed tolerant of unknown keys, and the one
admission path for HTTP and WebSocket creates (the rate limit first, then the body, then the
transport's own rules)."""

import pytest

from cluster.protocol.errors import ApiError, loc_to_param
from cluster.protocol.requests import MULTI_AGENT_BETA, admit_create, parse_request


def test_string_input_becomes_one_user_message():
    req = parse_request({"model": "m", "input": "hello"})
    assert req.input_items() == [{"type": "message", "role": "user", "content": "hello"}]
    assert req.store is True  # docs/protocol.md: store defaults to true


def test_unknown_keys_are_accepted_and_ignored():
    req = parse_request(
        {"model": "m", "input": "x", "client_metadata": {"a": 1}, "stream_options": {}, "prompt": {"id": "p"}}
    )
    assert req.model == "m"


def test_message_type_is_optional_and_items_keep_their_fields():
    req = parse_request(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "namespace": "ns"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}]},
            ]
        }
    )
    items = req.input_items()
    assert items[0]["type"] == "message" and items[0]["content"][0]["text"] == "hi"
    assert items[1]["namespace"] == "ns"
    assert items[3]["summary"][0]["text"] == "s"


def test_unknown_item_type_is_a_400_naming_the_item():
    with pytest.raises(ApiError) as e:
        parse_request({"input": [{"type": "message", "role": "user", "content": "x"}, {"type": "bogus"}]})
    assert e.value.status == 400
    assert e.value.param == "input[1].type"


def test_missing_field_names_its_path():
    with pytest.raises(ApiError) as e:
        parse_request({"input": [{"type": "function_call_output", "output": "x"}]})
    assert e.value.status == 400
    assert e.value.param == "input[0].call_id"
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"stream_id": "bad id!"}, "stream_id"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"truncation": "sometimes"}, "truncation"),
    ],
)
def test_bad_fields_are_400s(body, param):
    with pytest.raises(ApiError) as e:
        parse_request({"input": "x", **body})
    assert e.value.status == 400
    assert e.value.param == param


def test_body_must_be_an_object():
    with pytest.raises(ApiError):
        parse_request([1, 2])


def test_error_shapes():
    err = ApiError(400, "nope", code="c", param="p")
    assert err.http_body() == {"error": {"message": "nope", "type": "invalid_request_error", "param": "p", "code": "c"}}
    ws = err.ws_event()
    assert ws["type"] == "error" and ws["status"] == 400 and ws["error"]["type"] == "invalid_request_error"
    sse = err.sse_event(7)
    assert sse["sequence_number"] == 7 and sse["code"] == "c" and sse["error"]["message"] == "nope"


def test_loc_to_param():
    assert loc_to_param(("input", 0, "function_call_output", "call_id")) == "input[0].call_id"


def test_nested_field_names_survive():
    assert loc_to_param(("reasoning", "effort")) == "reasoning.effort"
    assert loc_to_param(("input", "str")) == "input"


def test_function_parameters_must_be_a_schema_object():
    from cluster.protocol.errors import ApiError
    from cluster.protocol.requests import parse_request

    for bad in ([None], "string", 3):
        try:
            parse_request({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": bad}]})
        except ApiError as err:
            assert err.status == 400 and err.param == "tools" and "parameters" in err.message
        else:
            raise AssertionError(f"parameters={bad!r} was accepted")
    parse_request({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]})


# Admission: one path for HTTP and WebSocket creates.

MULTI = {"input": "go", "multi_agent": {"enabled": True}}


def refused(body, **kw) -> ApiError:
    with pytest.raises(ApiError) as err:
        admit_create(body, admit=None, max_input_items=None, **kw)
    return err.value


def test_every_create_counts_against_the_rate_limit_even_an_invalid_one():
    calls = []
    with pytest.raises(ApiError):
        admit_create({"input": 5}, transport="http", admit=lambda: calls.append(1), max_input_items=None)
    assert calls == [1]


def test_multi_agent_is_websocket_only_and_needs_the_beta_header():
    assert refused(MULTI, transport="http").code == "unsupported_value"
    assert refused(MULTI, transport="websocket").param == "multi_agent"
    req = admit_create(MULTI, transport="websocket", admit=None, max_input_items=None,
                       betas=frozenset({MULTI_AGENT_BETA}))
    assert req.input == "go"


def test_background_is_http_only_and_never_streamed():
    assert refused({"input": "x", "background": True}, transport="websocket").param == "background"
    assert refused({"input": "x", "background": True, "stream": True}, transport="http").param == "stream"
    assert admit_create({"input": "x", "background": True}, transport="http", admit=None,
                        max_input_items=None).background


def test_the_item_bound_applies_on_both_transports():
    for transport in ("http", "websocket"):
        with pytest.raises(ApiError) as err:
            admit_create({"input": [{"role": "user", "content": "a"}] * 3}, transport=transport, admit=None,
                         max_input_items=2)
        assert err.value.code == "array_above_max_length"


@pytest.mark.parametrize("item", [
    {"type": "function_call", "call_id": "c" * 257, "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c" * 257, "output": "x"},
    {"type": "message", "role": "user", "content": "x", "id": "m" * 10_000},
    {"type": "item_reference", "id": "r" * 257},
])
def test_item_ids_and_call_ids_are_bounded_before_they_reach_an_index_or_an_error_message(item):
    with pytest.raises(ApiError) as e:
        parse_request({"input": [item]})
    assert e.value.status == 400 and e.value.param.startswith("input[0].")
    assert len(e.value.message) < 1000  # the id is not echoed whole
