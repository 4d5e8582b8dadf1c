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
