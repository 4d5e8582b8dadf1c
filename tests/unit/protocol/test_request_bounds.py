"""What a response echoes without rendering is bounded at parse time (audit-2 N2): a stored row
keeps it, and every GET returns it."""

import pytest

from cluster.protocol.errors import ApiError
from cluster.protocol.request_bounds import MAX_ECHO_CHARS
from cluster.protocol.requests import parse_request


def test_a_tool_the_model_is_not_offered_is_bounded_as_echo():
    body = {"input": "hi", "tools": [{"type": "web_search", "x": "A" * MAX_ECHO_CHARS}]}
    with pytest.raises(ApiError) as err:
        parse_request(body)
    assert (err.value.status, err.value.code, err.value.param) == (400, "string_above_max_length", "tools")


@pytest.mark.parametrize("field,value", [
    ("text", {"format": {"type": "text"}, "extra": "B" * MAX_ECHO_CHARS}),
    ("reasoning", {"effort": "low", "notes": ["C" * 1000] * 1100}),
    ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f" * 1000}] * 1100}),
])
def test_echoed_fields_are_bounded_together_and_the_largest_is_named(field, value):
    with pytest.raises(ApiError) as err:
        parse_request({"input": "hi", field: value})
    assert err.value.param == field


def test_ordinary_echo_and_large_function_tools_pass():
    """Function tools are rendered (the pre-tokenize floor bounds them), so only the rest counts."""
    tools = [{"type": "function", "name": f"f{i}", "description": "d" * 20_000,
              "parameters": {"type": "object", "properties": {}}} for i in range(60)]
    req = parse_request({"input": "hi", "tools": [*tools, {"type": "web_search"}], "text": {"verbosity": "low"},
                         "reasoning": {"effort": "high", "summary": "auto"}, "tool_choice": "auto"})
    assert len(req.tools) == 61


@pytest.mark.parametrize("shape", ["small items", "non-ascii text", "numbers", "nested tool schema"])
def test_what_a_parsed_body_holds_is_bounded_above_from_its_text(shape):
    """A waiting create is counted as what it holds parsed (audit-2 N3); the estimate weighs its
    containers from the value and its leaves from the text, and must not fall below what
    json.loads allocates, for any shape a client can send."""
    import json
    import tracemalloc

    from cluster.protocol.request_bounds import json_shape

    value = {
        "small items": {"input": [{"role": "user", "content": "a"} for _ in range(5_000)]},
        "non-ascii text": {"input": [{"role": "user", "content": "語" * 2_000 + str(i)} for i in range(200)]},
        "numbers": {"input": "x", "metadata": {"v": [i * 1_000_003 + 0.5 for i in range(20_000)]}},
        "nested tool schema": {"input": "x", "tools": [{"type": "function", "name": f"f{i}", "parameters": {
            "type": "object", "properties": {f"p{j}": {"type": "array", "items": {"type": "integer"}} for j in range(40)}}}
            for i in range(100)]},
    }[shape]
    raw = json.dumps(value, ensure_ascii=False)
    tracemalloc.start()
    parsed = json.loads(raw)
    allocated = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    error, held = json_shape(parsed, raw)
    assert error is None and held >= allocated
    assert held <= 8 * allocated + 4 * len(raw)  # an upper bound, not a refusal of everything
