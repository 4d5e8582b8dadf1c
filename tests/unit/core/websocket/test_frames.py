"""A frame's JSON read once: the full read of a client event, and the peek at a large create."""

from __future__ import annotations

import json

import pytest

from cluster.core.websocket.frames import load_event, peek_create
from cluster.protocol.errors import ApiError


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
