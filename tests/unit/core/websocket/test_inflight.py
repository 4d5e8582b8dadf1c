"""What a replica's sockets may hold together (first audit #5: steering input and injected
outputs were bounded per socket only, so a replica's ceiling was that times its sockets)."""

from cluster.core.turn.cache import SessionCache
from cluster.core.websocket.inflight import InFlight, ReplicaHeld, WsCreate


def running(inflight: InFlight, response_id: str) -> WsCreate:
    create = WsCreate({}, None, None)
    create.steerable, create.calls = True, 1  # it owes a tool call: a steer waits for it to stop
    inflight.started(create, response_id)
    return create


def steer(response_id: str, chars: int) -> dict:  # holds ~2x chars (its input and its items)
    return {"type": "response.steer", "previous_response_id": response_id, "input": "s" * chars}


def test_steering_input_on_every_socket_of_a_replica_counts_against_one_bound():
    clock = [0.0]
    sockets: list[InFlight] = []
    held = ReplicaHeld(limit=300_000, sample=lambda: sum(s.held_bytes() for s in sockets), clock=lambda: clock[0])
    a, b = InFlight(held), InFlight(held)
    sockets += [a, b]
    running(a, "resp_a")
    running(b, "resp_b")
    [accepted] = a.steer(steer("resp_a", 100_000), SessionCache(), [])
    assert accepted["type"] == "response.steer.accepted"
    [refused] = b.steer(steer("resp_b", 100_000), SessionCache(), [])  # b holds nothing itself
    assert refused["type"] == "response.steer.failed" and refused["error"]["code"] == "too_many_pending_steers"
    assert "across its connections" in refused["error"]["message"]
    a.ended("resp_a")  # a's response ended: its steering input is gone
    clock[0] += 0.2  # the next sample sees it
    [accepted] = b.steer(steer("resp_b", 100_000), SessionCache(), [])
    assert accepted["type"] == "response.steer.accepted"
