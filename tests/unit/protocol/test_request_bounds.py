"""What a response echoes without rendering is bounded at parse time: a stored row
keeps it, and every GET returns it."""

import json

import pytest

from cluster.protocol.errors import ApiError
from cluster.protocol.request_bounds import MAX_ECHO_CHARS, load_event, peek_create
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
    """A waiting create is counted as what it holds parsed; the estimate weighs its
    containers and its leaves from the text, and must not fall below what
    json.loads allocates, for any shape a client can send."""
    import json
    import tracemalloc

    from cluster.protocol.request_bounds import json_bounds

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
    error, held = json_bounds(raw)
    assert error is None and held >= allocated
    assert held <= 8 * allocated + 4 * len(raw)  # an upper bound, not a refusal of everything


# A WebSocket frame's JSON read once: the full read of a client event, and the peek at a large create.
def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_the_peek_builds_every_field_of_a_create_but_its_input():
    body = {"model": "m", "previous_response_id": "resp_1", "tools": [{"type": "function", "name": "f"}],
            "temperature": 0.5, "stream_id": "lane-1", "metadata": {"k": "ü"}}
    frame = json.dumps({"type": "response.create", **body, "input": [{"role": "user", "content": "a"}] * 1000})
    assert peek_create(frame) == body
    assert peek_create(frame.encode()) == body  # a binary frame alike


@pytest.mark.parametrize("frame", [
    '{"type": "response.create", "response": {"input": "a"}}',  # the nested form: parsed whole
    '{"type": "response.steer", "input": "a", "response_id": "r"}',  # not a create
    '{"type": "response.create", "input": [1, 2',  # not JSON
    '[{"type": "response.create", "input": "a"}]',  # not an object
    '{"type": 3, "input": "a"}',
    '{"type": "response.create", "input": "a", "temperature": NaN}',  # json.loads reads it; the peek does not
    json.dumps({"type": "response.create", "input": "a", "tools": nested(80)}),  # nested too deeply
    '{"type":"response.create","input":' + "[" * 3000 + "]" * 3000 + "}",  # past msgspec's recursion
])
def test_what_the_peek_cannot_read_as_the_full_path_would_goes_the_full_path(frame):
    assert peek_create(frame) is None


@pytest.mark.parametrize("frame, code", [
    ("{not json", "invalid_json"),
    ("[1]", "missing_required_parameter"),
    ('{"no_type": 1}', "missing_required_parameter"),
    (json.dumps({"type": "response.create", "input": nested(80)}), "invalid_value"),
    ("[" * 250_000, "json_too_complex"),
])
def test_a_frame_the_full_read_refuses_is_a_400_naming_why(frame, code):
    with pytest.raises(ApiError) as refused:
        load_event(frame)
    assert refused.value.status == 400 and refused.value.code == code


def test_the_full_read_weighs_what_it_holds():
    event, held = load_event(json.dumps({"type": "response.create", "input": [{"role": "user", "content": "a"}] * 1000}))
    assert len(event["input"]) == 1000 and held > 1000 * 100


def test_nesting_is_read_from_the_text_as_json_loads_reads_it():
    """The depth bound is read from the bytes before parsing, brackets inside strings
    (escaped quotes, escaped backslashes) not counted; it must agree with the parsed value's depth."""
    import random

    from cluster.protocol.request_bounds import json_nesting

    def depth(v):
        inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        return 0 if inner is None else 1 + max((depth(x) for x in inner), default=0)

    rng = random.Random(7)

    def value(d):
        r = rng.random()
        if d > 6 or r < 0.3:
            return rng.choice(['a\\"[', "\\", "]}", 1, None, "x" * rng.randint(0, 5) + '\\"{', "語[", "\\\\"])
        if r < 0.65:
            return [value(d + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["[", "k", '\\"{']) + str(i): value(d + 1) for i in range(rng.randint(0, 4))}

    for _ in range(2000):
        v = value(0)
        text = json.dumps(v, ensure_ascii=rng.random() < 0.5)
        assert json_nesting(text) == depth(v) == json_nesting(text.encode()), text


@pytest.mark.parametrize("raw", [
    "[" + "[]," * 21_800 + "[]]",  # 64 KiB of the worst shape for a walk of the parsed value
    json.dumps({"input": [{"role": "user", "content": "hello"}] * 2_000}).encode(),
])
def test_the_bounds_of_a_frame_are_read_without_building_it(raw, monkeypatch):
    """The per-container Python walk of the parsed value cost ~15x a create's byte
    budget on `[[],[],...]` (17 ms a 64 KiB frame); the bounds come from the text alone, before
    anything is built (timings: bench/adversarial.py)."""
    from cluster.protocol import request_bounds

    def built(*args, **kw):
        raise AssertionError("the bounds built the value")

    monkeypatch.setattr(request_bounds.json, "loads", built)
    monkeypatch.setattr(request_bounds, "_levels", built)
    error, held = request_bounds.json_bounds(raw)
    assert error is None and held > len(raw)


def test_a_body_nesting_too_deeply_is_refused_from_its_text_naming_the_field():
    from cluster.protocol.request_bounds import json_bounds

    error, _ = json_bounds(json.dumps({"input": "hi", "tools": nested(65)}))
    assert error is not None and error.param == "tools" and error.code == "invalid_value"
    assert json_bounds(json.dumps({"input": "hi", "tools": nested(63)}))[0] is None
    assert json_bounds(json.dumps({"input": "hi", "tools": '"' + "[" * 500}))[0] is None  # inside a string
