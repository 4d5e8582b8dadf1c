"""WebSocket mode's rules on the sans-I/O protocol alone: frames and lane progress in, actions
out, time from a fake clock. No driver, no tasks, no socket."""

from __future__ import annotations

import json

from cluster.config import WebSocketConfig
from cluster.core.turn.cache import SessionCache
from cluster.core.websocket.inflight import WsCreate
from cluster.core.websocket.protocol import (
    MAX_ACTIVE,
    MAX_LANES,
    Close,
    DeferredError,
    Enqueued,
    RunLane,
    SendError,
    SendEvent,
    State,
    WebSocketProtocol,
)
from cluster.protocol.errors import ApiError
from cluster.protocol.request_bounds import ReplicaQueue
from cluster.protocol.requests import admit_create, parse_request


def protocol(**cfg) -> WebSocketProtocol:
    return WebSocketProtocol(WebSocketConfig(**cfg), model_name="m", max_input_items=None, cache=SessionCache(),
                             now=0.0)


def create(input="hi", **extra) -> str:
    return json.dumps({"type": "response.create", "input": input, **extra})


def enqueued(actions) -> Enqueued:
    [e] = [a for a in actions if isinstance(a, Enqueued)]
    return e


def errors(actions) -> list[str]:
    return [a.error.code for a in actions if isinstance(a, SendError)]


def test_creates_on_a_lane_run_in_order_and_one_that_waits_is_announced_with_its_id():
    p = protocol()
    first = p.receive(create("a"), now=1.0)
    assert enqueued(first).announce is None and RunLane("") in first
    second = enqueued(p.receive(create("b"), now=1.1))
    assert second.announce["type"] == "response.queued" and second.announce["response"]["status"] == "queued"
    assert second.announce["response"]["id"] == second.create.response_id
    taken = p.next_on_lane("")
    assert isinstance(taken, WsCreate) and taken.body["input"] == "a" and p.busy
    assert p.next_on_lane("").body["input"] == "b"
    assert p.next_on_lane("") is None and p.waiting_creates == 0 and p.queued_bytes == 0


def test_a_frames_error_keeps_its_place_behind_the_response_before_it():
    p = protocol()
    p.receive(create("a"), now=1.0)
    assert p.receive("{not json", now=1.1) == [RunLane("")]
    assert p.receive(json.dumps({"type": "response.cancel_everything"}), now=1.2) == [RunLane("")]
    assert isinstance(p.next_on_lane(""), WsCreate)
    bad_json, bad_type = p.next_on_lane(""), p.next_on_lane("")
    assert isinstance(bad_json, DeferredError) and bad_json.error.code == "invalid_json"
    assert bad_type.error.code == "invalid_value" and bad_type.error.param == "type"
    assert p.deferred_errors == 0 and p.queued_bytes == 0


def test_ignored_events_do_nothing():
    p = protocol()
    assert p.receive(json.dumps({"type": "response.processed", "response_id": "x"}), now=1.0) == []
    assert not p.busy


def test_lanes_are_bounded_and_named_correctly():
    p = protocol(max_queued_creates=1000)
    assert p.receive(create(stream_id="no spaces"), now=1.0) == [RunLane("")]
    assert p.next_on_lane("").error.code == "invalid_stream_id"
    for n in range(MAX_LANES):
        enqueued(p.receive(create(stream_id=f"lane{n}"), now=1.0))
    assert p.receive(create(stream_id="one-too-many"), now=1.0) == [RunLane("")]
    refused = p.next_on_lane("")
    assert refused.error.code == "websocket_stream_limit_reached" and refused.stream_id == "one-too-many"


def test_past_max_active_lanes_a_create_waits_and_is_announced():
    p = protocol(max_queued_creates=1000)
    for n in range(MAX_ACTIVE):
        assert enqueued(p.receive(create(stream_id=f"lane{n}"), now=1.0)).announce is None
    late = enqueued(p.receive(create(stream_id="late"), now=1.0))
    assert late.announce is not None and late.announce["stream_id"] == "late"
    # parsed to announce it, but only its id is kept while it waits (the parsed request would
    # hold the body a second time): the lane parses it again when it starts
    assert late.create.response_id == late.announce["response"]["id"]
    assert not hasattr(late.create, "request")
    assert admit_create(late.create.body, transport="websocket", admit=None, max_input_items=None).stream_id == "late"


def test_announcing_a_waiting_create_does_not_validate_its_input(monkeypatch):
    """64 waiting creates of 10,000 items each were validated on arrival to announce
    them, then again when they started (~3 s of the replica's loop); the announcement needs the
    settings only."""
    from cluster.core.websocket import inflight

    seen = []
    real = inflight.parse_request
    monkeypatch.setattr(inflight, "parse_request",
                        lambda body, **kw: seen.append(len(body.get("input") or [])) or real(body, **kw))
    p = protocol(max_queued_bytes=64 * 1024 * 1024)
    p.receive(create("in flight"), now=1.0)
    waiting = enqueued(p.receive(create([{"role": "user", "content": "a"}] * 10_000, max_output_tokens=9), now=1.0))
    assert waiting.announce["response"]["max_output_tokens"] == 9 and seen == [0]


def test_waiting_creates_and_bytes_are_bounded_and_refused_at_once():
    p = protocol(max_queued_creates=3, max_queued_bytes=10_000)
    for _ in range(3):
        enqueued(p.receive(create(), now=1.0))
    assert errors(p.receive(create(), now=1.0)) == ["rate_limit_exceeded"]
    q = protocol(max_queued_bytes=1000)
    enqueued(q.receive(create("x" * 600), now=1.0))
    assert errors(q.receive(create("y" * 600), now=1.0)) == ["rate_limit_exceeded"]
    assert q.waiting_creates == 1
    # bytes as they came over the wire, not characters: 250 emoji are 1,000 bytes
    def raw_create(text: str) -> str:  # the characters themselves in the frame, as a client may send them
        return json.dumps({"type": "response.create", "input": text}, ensure_ascii=False)

    r = protocol(max_queued_bytes=1200)
    assert enqueued(r.receive(raw_create("\U0001F600" * 250), now=1.0)).create.nbytes > 1000
    assert errors(r.receive(raw_create("\U0001F600" * 100), now=1.0)) == ["rate_limit_exceeded"]


def test_a_large_waiting_create_is_held_as_its_frame_and_counted_as_what_it_holds():
    """10,000 one-character messages are a 300 KB frame that holds ~3 MB in ~30,000 objects once
    parsed; held parsed while it waits, every full collection of Python's GC walks
    them (seconds of stall for a queue of them). It waits as the frame, is counted at least as
    what it holds, and is whole again when its lane starts it."""
    import gc
    import tracemalloc

    frame = create([{"role": "user", "content": "a"} for _ in range(10_000)])
    tracemalloc.start()
    parsed = json.loads(frame)
    parsed_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del parsed
    p = protocol(max_queued_bytes=64 * 1024 * 1024)
    p.receive(create("in flight"), now=1.0)
    tracked = len(gc.get_objects())
    tracemalloc.start()
    waiting = enqueued(p.receive(frame, now=1.0))
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert waiting.announce is not None and waiting.announce["response"]["status"] == "queued"
    assert len(gc.get_objects()) - tracked < 200  # no parsed items for the GC to walk
    assert held < parsed_bytes / 4 and waiting.create.nbytes >= held
    assert len(waiting.create.start_body()["input"]) == 10_000
    q = protocol(max_queued_bytes=len(frame))  # the frame alone fits; it is counted with its ids
    q.receive(create("in flight"), now=1.0)
    assert errors(q.receive(frame, now=1.0)) == ["rate_limit_exceeded"] and q.waiting_creates == 1


def test_what_waits_on_every_socket_of_a_replica_is_bounded_together():
    shared = ReplicaQueue(limit=20_000)
    a, b = (WebSocketProtocol(WebSocketConfig(), model_name="m", max_input_items=None, cache=SessionCache(), now=0.0,
                              replica_queue=shared) for _ in range(2))
    a.receive(create("x" * 12_000), now=1.0)
    refused = b.receive(create("y" * 12_000), now=1.0)
    assert errors(refused) == ["rate_limit_exceeded"] and "retry" in refused[0].error.message
    assert a.next_on_lane("") is not None and shared.held == 0  # started: no longer waiting
    enqueued(b.receive(create("y" * 12_000), now=1.0))
    b.client_left()  # a socket that goes away gives back what waited on it
    assert shared.held == 0


def test_a_large_frame_counts_against_the_key_s_limit_before_it_is_parsed():
    """A key past its limit costs no parse; a create counted on arrival is not counted again."""
    from cluster.protocol.errors import ApiError as Err

    budget, told = [2], []

    def admit(nbytes):
        if budget[0] == 0:
            raise Err(429, "Rate limit reached.", code="rate_limit_exceeded")
        budget[0] -= 1
        told.append(nbytes)

    p = WebSocketProtocol(WebSocketConfig(), model_name="m", max_input_items=None, cache=SessionCache(), now=0.0,
                          admit=admit)
    big = create("x" * 100_000)
    assert enqueued(p.receive(big, now=1.0)).create.admitted and told == [len(big)]  # its bytes count too
    small = enqueued(p.receive(create("small"), now=1.0)).create
    assert not small.admitted and small.size == len(create("small"))  # counted, with its size, when it starts
    p.receive("{" + "x" * 100_000, now=1.0)  # invalid JSON, counted all the same
    over = p.receive("{" + "x" * 100_000, now=1.0)
    assert errors(over) == ["rate_limit_exceeded"] and p.deferred_errors == 1  # not parsed: no invalid_json


def test_a_frame_opening_too_many_objects_is_refused_unparsed():
    p = protocol(max_queued_creates=10)
    p.receive(create("in flight"), now=1.0)
    assert p.receive(create([{}] * 250_000), now=1.0) == [RunLane("")]
    p.next_on_lane("")
    assert p.next_on_lane("").error.code == "json_too_complex"


def test_errors_answered_at_once_still_end_a_flooding_connection():
    """Under Serve's Python proxy a send never blocks, so errors never wait to be read;
    a client sending invalid frames nonstop is closed by the bytes of errors it made the server say."""
    p = protocol(max_error_bytes_per_minute=64 * 1024)
    sent = 0
    for n in range(10_000):
        actions = p.receive("x", now=1.0 + n * 0.0001)
        p.next_on_lane("")  # its error went out at once (the lane is idle)
        if p.state is State.CLOSED:
            break
        sent += 1
    assert p.state is State.CLOSED and actions[-1] == Close(1008, "too many errors not read")
    assert errors(actions) == ["too_many_errors"]
    assert sent * 256 <= 64 * 1024 + 512  # no more than the budget's worth of errors went out
    # An honest client's rare error never comes near it: the budget refills over a minute.
    q = protocol(max_error_bytes_per_minute=64 * 1024)
    for n in range(600):
        q.receive("x", now=1.0 + n)  # one bad frame a second for ten minutes
        q.next_on_lane("")
    assert q.state is State.OPEN


def test_failed_steers_returning_large_inputs_count_against_the_same_budget():
    p = protocol(max_error_bytes_per_minute=1024 * 1024)
    steer = json.dumps({"type": "response.steer", "response_id": "resp_unknown",
                        "input": [{"role": "user", "content": "z" * 200_000}]})
    outcomes = [p.receive(steer, now=1.0) for _ in range(10)]
    assert p.state is State.CLOSED
    assert sum(1 for a in outcomes if a and not isinstance(a[-1], Close)) <= 5


def test_an_oversized_frame_is_never_held_and_errors_nobody_reads_end_the_connection():
    p = protocol(max_frame_bytes=100, max_queued_creates=4)
    p.receive(create("a"), now=1.0)  # in flight: the errors below wait behind it
    for _ in range(3):
        assert p.receive("x" * 10_000, now=1.0) == [RunLane("")]
    assert p.queued_bytes < 4 * 512
    assert errors(p.receive("x", now=1.0)) == ["rate_limit_exceeded"]  # 1 create + 3 errors waiting
    q = protocol(max_frame_bytes=100, max_queued_creates=4)
    for _ in range(4):
        q.receive("x" * 10_000, now=1.0)
    flood = q.receive("x", now=1.0)
    assert errors(flood) == ["too_many_errors"] and flood[-1] == Close(1008, "too many errors not read")
    assert q.state is State.CLOSED and q.receive(create(), now=1.0) == []


def test_the_lifetime_limit_waits_for_the_response_in_flight_then_closes():
    p = protocol(max_connection_seconds=60, idle_timeout_seconds=1000)
    actions, wait = p.tick(0.0)
    assert actions == [] and wait == 60
    p.receive(create(), now=10.0)
    p.next_on_lane("")
    actions, wait = p.tick(60.0)
    assert actions == [] and wait is None and p.state is State.ENDING
    assert p.receive(create(), now=61.0) == []  # an ending connection takes nothing more
    p.turn_ended("", now=70.0)
    closing = p.lane_stopped("")
    assert errors(closing) == ["websocket_connection_limit_reached"]
    assert "limit reached (1 minute)" in closing[0].error.message  # what the config says, not OpenAI's 60
    assert closing[-1] == Close(1000, "connection limit reached") and p.state is State.CLOSED


def test_the_lifetime_limit_message_says_the_configured_lifetime():
    for seconds, words in ((3600, "(60 minutes)"), (90, "(90 seconds)"), (7200, "(120 minutes)")):
        p = protocol(max_connection_seconds=seconds, idle_timeout_seconds=100_000)
        closing, _ = p.tick(float(seconds))  # nothing in flight: it closes at once
        assert errors(closing) == ["websocket_connection_limit_reached"] and words in closing[0].error.message


def test_an_idle_connection_closes_but_not_while_a_response_runs():
    p = protocol(max_connection_seconds=3600, idle_timeout_seconds=30)
    p.receive(create(), now=1.0)
    p.next_on_lane("")
    actions, wait = p.tick(40.0)
    assert actions == [] and wait == 0.5  # busy: checked again shortly
    p.turn_ended("", now=40.0)
    assert p.lane_stopped("") == []
    assert p.tick(50.0) == ([], 20.0)
    actions, wait = p.tick(70.0)
    assert errors(actions) == ["websocket_connection_limit_reached"] and "30 seconds" in actions[0].error.message
    assert wait is None and p.state is State.CLOSED


def test_a_drain_finishes_the_response_in_flight_and_closes_with_1001():
    p = protocol()
    p.receive(create(), now=1.0)
    p.next_on_lane("")
    assert p.drain() == [] and p.state is State.ENDING
    p.turn_ended("", now=2.0)
    closing = p.lane_stopped("")
    assert closing[-1] == Close(1001, "server draining: reconnect")
    idle = protocol()
    assert idle.drain()[-1].code == 1001


def test_interrupts_and_steers_act_at_once_never_queued():
    p = protocol()
    # An interrupt without an id is an error in FIFO order; one for a response that ended is ignored
    # (an error would be read as the next turn's first event).
    assert p.receive(json.dumps({"type": "response.interrupt"}), now=1.0) == [RunLane("")]
    assert p.next_on_lane("").error.code == "missing_required_parameter"
    assert p.receive(json.dumps({"type": "response.interrupt", "response_id": "resp_gone"}), now=1.0) == []
    # A steer is answered at once, even with a response waiting on the lane.
    p.receive(create("a"), now=1.0)
    [answer] = p.receive(json.dumps({"type": "response.steer", "previous_response_id": "resp_nope",
                                     "input": "x"}), now=1.0)
    assert isinstance(answer, SendEvent) and answer.event["type"] == "response.steer.failed"
    assert answer.event["error"]["code"] == "response_not_found"


def test_when_the_client_leaves_nothing_waits():
    p = protocol()
    p.receive(create(), now=1.0)
    p.receive("{", now=1.0)
    p.client_left()
    assert p.state is State.CLOSED and p.next_on_lane("") is None
    assert (p.queued_bytes, p.waiting_creates, p.deferred_errors) == (0, 0, 0)


def test_a_large_create_that_waits_is_parsed_once_when_its_lane_starts_it(monkeypatch):
    """A 300 KB frame of 10,000 items parsed on arrival only to be dropped and parsed again at its
    start held the loop twice; only its fields other than `input` are read on arrival."""
    frame = create([{"role": "user", "content": "a"} for _ in range(10_000)], previous_response_id="resp_1")
    parsed = []
    loads = json.loads

    def counting(data, *a, **k):
        if len(data) >= len(frame):
            parsed.append(len(data))
        return loads(data, *a, **k)

    monkeypatch.setattr(json, "loads", counting)
    p = protocol(max_queued_bytes=64 * 1024 * 1024)
    p.receive(create("in flight"), now=1.0)
    waiting = enqueued(p.receive(frame, now=1.0))
    assert parsed == [] and waiting.create.admitted is False and waiting.create.frame is not None
    assert waiting.announce["response"]["previous_response_id"] == "resp_1"
    assert waiting.create.nbytes >= 2 * len(frame)
    p.next_on_lane("")
    assert p.next_on_lane("") is waiting.create
    assert len(waiting.create.start_body()["input"]) == 10_000 and parsed == [len(frame)]


def test_a_waiting_create_whose_input_nests_too_deeply_is_refused_on_arrival_in_its_place():
    """The nesting is read from the frame's text before anything is parsed or held:
    a large create that would wait is refused at once, its error behind the response in flight."""
    deep: object = "a"
    for _ in range(80):
        deep = [deep]
    frame = create([{"role": "user", "content": "x" * 70_000}, deep])
    p = protocol()
    p.receive(create("in flight"), now=1.0)
    p.receive(frame, now=1.0)
    assert p.waiting_creates == 1 and isinstance(p.next_on_lane(""), WsCreate)
    refused = p.next_on_lane("")
    assert isinstance(refused, DeferredError) and refused.error.code == "invalid_value"
    assert "nested too deeply" in refused.error.message and refused.error.param == "input"


# -- a create's turn: what the protocol decides around it (the session only runs it) ------
def started(p: WebSocketProtocol, frame: str, response_id: str, key: str = "") -> WsCreate:
    p.receive(frame, now=1.0)
    item = p.next_on_lane(key)
    body, _ = p.begin_turn(item, item.start_body())
    p.turn_admitted(item, parse_request(body), body)
    p.turn_event(item, {"type": "response.created", "response": {"id": response_id}})
    return item


def ended(p: WebSocketProtocol, item: WsCreate, status: str, output=(), reason=None):
    final = {"id": item.response_id, "status": status, "output": list(output),
             "incomplete_details": {"reason": reason} if reason else None}
    p.turn_event(item, {"type": f"response.{status}", "response": final})
    return p.turn_finished(item)


def steer(response_id: str, text: str) -> str:
    return json.dumps({"type": "response.steer", "previous_response_id": response_id, "input": text})


def test_a_steered_response_stops_and_its_successor_carries_the_steering_input():
    p = protocol()
    item = started(p, create("write a poem"), "resp_1")
    [accepted] = p.receive(steer("resp_1", "make it short"), now=1.5)
    assert accepted.event["type"] == "response.steer.accepted" and item.stop.reason == "steered"
    successor, actions = ended(p, item, "incomplete", reason="steered")
    assert actions == [] and list(p.finished) == ["resp_1"]
    assert successor.body["previous_response_id"] == "resp_1"
    assert successor.body["input"] == [{"type": "message", "role": "user", "content": "make it short"}]
    assert [s.previous_response_id for s in successor.commits] == ["resp_1"]
    assert p.held_bytes() == 0  # the ended response holds nothing; the successor carries the input


def test_a_steer_for_a_response_owing_tool_output_waits_for_the_clients_next_create():
    p = protocol()
    item = started(p, create("list files"), "resp_1")
    call = {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"}
    p.turn_event(item, {"type": "response.output_item.added", "item": call})
    [accepted] = p.receive(steer("resp_1", "only .py"), now=1.5)
    assert accepted.event["type"] == "response.steer.accepted" and not item.stop.is_set()  # the call is owed
    successor, actions = ended(p, item, "completed", output=[call])
    assert successor is None
    [pending] = [a.event for a in actions]
    assert pending["type"] == "response.steer.pending" and pending["required_input"][0]["call_id"] == "c1"
    p.turn_ended("", 2.0)
    # The client's continuation: the steering input goes first, its own tool output after it.
    output = {"type": "function_call_output", "call_id": "c1", "output": "a.py"}
    p.receive(create([output], previous_response_id="resp_1"), now=2.1)
    nxt = p.next_on_lane("")
    body, keep_parent = p.begin_turn(nxt, nxt.start_body())
    assert [i.get("content", i.get("output")) for i in body["input"]] == ["only .py", "a.py"] and not keep_parent
    # It fails before its response exists: the steer comes back failed, not as a plain error.
    successor, actions = p.turn_finished(nxt, ApiError(400, "bad tool output", code="invalid_value"))
    [failed] = [a.event for a in actions]
    assert successor is None and failed["type"] == "response.steer.failed"
    assert failed["error"]["code"] == "successor_creation_failed" and failed["steer"]["input"] == "only .py"


def test_a_failed_turn_sends_its_error_on_its_lane():
    p = protocol()
    p.receive(create("hi", stream_id="s1"), now=1.0)
    item = p.next_on_lane("s1")
    successor, actions = p.turn_finished(item, ApiError(400, "nope", code="invalid_value"))
    assert successor is None and [(a.error.code, a.stream_id) for a in actions] == [("invalid_value", "s1")]


def test_a_fork_of_another_lanes_response_waits_for_it_and_keeps_its_parent():
    p = protocol()
    source = started(p, create("a", stream_id="x"), "resp_x", key="x")
    p.receive(create("b", stream_id="y", previous_response_id="resp_x"), now=1.2)
    fork = p.next_on_lane("y")
    assert p.fork_source(fork) is source
    _, keep_parent = p.begin_turn(fork, fork.start_body())
    assert keep_parent  # its failure must not evict lane x's response


def test_steerability_and_the_multi_agent_inbox_are_decided_from_the_request():
    p = protocol()
    warm = started(p, create("hi", generate=False), "resp_w")
    assert not warm.steerable and warm.inbox is None
    [refused] = p.receive(steer("resp_w", "x"), now=1.5)
    assert refused.event["error"]["code"] == "steering_not_supported"
    p.turn_ended("", 2.0)
    agent = started(p, create("hi", multi_agent={"enabled": True}), "resp_a")
    assert agent.steerable and agent.inbox is not None


def test_a_large_frame_nested_past_the_parsers_recursion_is_a_400_and_the_socket_stays():
    """Over the peek's size, nesting ~3000 deep raised RecursionError out of receive()
    (the route then ended the socket silently); it now gets the full path's 400 `invalid_json`."""
    p = protocol()
    deep = ('{"type":"response.create","instructions":"' + "a" * 70_000 + '","input":'
            + "[" * 3000 + "]" * 3000 + "}")
    p.receive(deep, 0.0)
    [item] = p.lanes[""].pending
    assert isinstance(item, DeferredError) and item.error.code == "invalid_value"  # read from its text first
    assert p.state is State.OPEN


def test_ignored_frames_are_dropped_unparsed(monkeypatch):
    """A `response.processed` of 64 KiB `[[],[],...]` was parsed and walked (7 + 17 ms)
    to be dropped; its type is read without building the rest, and nothing else runs."""
    from cluster.core.websocket import protocol as module

    def parsed(*args, **kw):
        raise AssertionError("an ignored frame was parsed")

    monkeypatch.setattr(module, "load_event", parsed)
    monkeypatch.setattr(module, "json_bounds", parsed)
    p = protocol()
    frame = '{"type":"response.processed","x":[' + ",".join(["[]"] * 21_800) + "]}"
    for kind in ("response.processed", "response.append"):
        assert p.receive(frame.replace("response.processed", kind), 0.0) == []
    assert p.state is State.OPEN and not p.lanes
    monkeypatch.undo()
    # a frame whose type cannot be read that way still gets the full path's answer
    p.receive('{"type": 5}', 0.0)
    [item] = p.lanes[""].pending
    assert isinstance(item, DeferredError) and item.error.param == "type"


def test_every_frame_is_paid_for_before_it_is_read(monkeypatch):
    """Frames under 64 KiB were parsed and walked before any limit, and
    `response.processed`/`response.append` were charged to nothing. Each frame's bytes now go to
    the key's window before it is parsed (a large one as a request), whatever its type."""
    charged, admitted = [], []
    p = WebSocketProtocol(WebSocketConfig(), model_name="m", max_input_items=None, cache=SessionCache(), now=0.0,
                          admit=admitted.append, charge=charged.append)
    small, ignored, invalid = create("a"), '{"type":"response.processed","x":[[],[]]}', "x"
    large = create("b" * 70_000)
    for frame in (small, ignored, invalid, large):
        p.receive(frame, 0.0)
    assert charged == [len(small), len(ignored), len(invalid)] and admitted == [len(large)]

    def refused(nbytes):
        raise ApiError(429, "Rate limit reached", code="rate_limit_exceeded")

    def parsed(*args, **kw):
        raise AssertionError("a frame past the key's limit was parsed")

    from cluster.core.websocket import protocol as module
    monkeypatch.setattr(module, "load_event", parsed)
    monkeypatch.setattr(module, "json_bounds", parsed)
    p.charge = refused
    assert errors(p.receive(small, 1.0)) == ["rate_limit_exceeded"] and errors(p.receive(ignored, 1.0)) == [
        "rate_limit_exceeded"]


def test_a_socket_past_its_frame_bytes_a_minute_is_refused_unread_then_closed(monkeypatch):
    """Keyless too: the socket's own bucket. A client that keeps sending past it spends its error
    budget on the 429s and is closed (1008); one that slows down is served again."""
    from cluster.core.websocket import protocol as module

    p = protocol(max_frame_bytes_per_minute=1 << 20, max_error_bytes_per_minute=64 * 1024)
    frame = '{"type":"response.append","x":"' + "a" * 60_000 + '"}'
    sent = [p.receive(frame, 0.0) for _ in range(17)]
    assert all(actions == [] for actions in sent) and p.state is State.OPEN  # 1 MiB passed
    monkeypatch.setattr(module, "frame_type", lambda *a: (_ for _ in ()).throw(AssertionError("read")))
    later = p.receive(frame, 0.0)
    assert errors(later) == ["rate_limit_exceeded"] and later[0].error.retry_after_s > 0
    monkeypatch.undo()
    assert p.receive(frame, 10.0) == []  # 10 s refill 170 KiB: served again
    flood = [p.receive(frame, 10.0) for _ in range(400)]
    assert p.state is State.CLOSED and flood[-1] == [] and any(Close(1008, "too many errors not read") in f for f in flood)
