"""A stored response replayed as its event stream (`GET /v1/responses/{id}?stream=true`)."""

from cluster.core.events import usage_object
from cluster.core.replay import replay_events
from cluster.protocol.errors import ApiError
from tests.unit.core.test_events import assembler, check


def test_replay_rebuilds_the_same_items():
    a = assembler()
    evs = a.start() + a.text("Hi there") + a.tool_call("f", '{"a": 1}') + a.finish(usage_object(3, 1, 2))
    final = evs[-1]["response"]
    replay = replay_events(final)
    check(replay)
    assert replay[-1]["response"]["output"] == final["output"]
    assert replay[-1]["response"]["usage"] == final["usage"]


def test_a_failed_response_replays_as_failed_with_its_error_and_partial_output():
    a = assembler()
    evs = a.start() + a.text("partial") + a.fail(ApiError(500, "the engine died", code="server_error"), usage_object(4, 0, 1))
    final = evs[-1]["response"]
    replay = replay_events(final)
    types = check(replay)
    assert types[-1] == "response.failed" and "error" not in types  # the original `error` event is not replayed
    assert replay[-1]["response"]["error"] == final["error"] == {"code": "server_error", "message": "the engine died"}
    assert replay[-1]["response"]["output"][0]["content"][0]["text"] == "partial"
    assert replay[-1]["response"]["usage"] == final["usage"]
