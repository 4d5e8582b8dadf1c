"""WebSocket mode rules (docs/protocol.md) on the WebSocket session (asyncio, a recording send; no socket)."""

import asyncio

import pytest

from tests.support.harness import InProcessStack
from tests.support.peer import TOOLS, Peer


@pytest.fixture
def stack(tokenizer):
    return InProcessStack(tokenizer)


async def test_flat_create_with_stream_true_and_ignored_events(stack):
    p = Peer(stack)
    await p.frame({"type": "response.create", "model": "loopserve-tiny", "input": "hi", "stream": True})
    await p.frame({"type": "response.processed", "response_id": "x"})
    await p.frame({"type": "response.append", "input": []})
    await p.idle()
    assert p.types()[0] == "response.created" and p.types()[-1] == "response.completed"
    assert "error" not in p.types()
    assert [e["sequence_number"] for e in p.sent] == list(range(len(p.sent)))
    await p.session.shutdown()


async def test_errors_keep_the_connection_working(stack):
    p = Peer(stack, max_frame_bytes=1000)
    await p.frame("{not json")
    await p.frame({"type": "response.cancel_everything"})
    await p.frame({"no_type": 1})
    await p.frame({"type": "response.create", "input": "x" * 2000})
    await p.frame({"type": "response.create", "input": "hi", "background": True})
    await p.frame({"type": "response.create", "input": "hi", "previous_response_id": "resp_missing"})
    await p.frame({"type": "response.create", "input": "hi"})
    await p.idle()
    errors = [e for e in p.sent if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == [
        "invalid_json", "invalid_value", "missing_required_parameter", "websocket_message_too_large", "invalid_value",
        "previous_response_not_found",
    ]
    assert all(e["error"]["type"] == "invalid_request_error" and e["status"] == 400 for e in errors)
    assert errors[4]["error"]["param"] == "background"
    assert errors[5]["error"]["message"] == "Previous response with id 'resp_missing' not found."
    assert p.types()[-1] == "response.completed"  # still serving
    assert p.closed is None
    await p.session.shutdown()


async def test_overlapping_creates_run_fifo_never_interleaved(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=400)
    p = Peer(stack)
    for i in range(3):
        await p.frame({"type": "response.create", "input": f"q{i}"})
    await p.idle()
    ids = [e["response"]["id"] if "response" in e else None for e in p.sent]
    created = [i for i, e in enumerate(p.sent) if e["type"] == "response.created"]
    done = [i for i, e in enumerate(p.sent) if e["type"] == "response.completed"]
    assert len(created) == 3 and len(done) == 3
    assert created[0] < done[0] < created[1] < done[1] < created[2] < done[2]
    # every event between created[k] and done[k] belongs to response k, and counts on from its
    # `response.queued` (sequence 0) where one announced it: the two that waited
    announced = {e["response"]["id"] for e in p.queued}
    assert announced == {ids[created[1]], ids[created[2]]}
    for k in range(3):
        block = p.sent[created[k]: done[k] + 1]
        first = int(ids[created[k]] in announced)
        assert [e["sequence_number"] for e in block] == list(range(first, first + len(block)))
    assert ids[created[0]] != ids[created[1]]
    await p.session.shutdown()


async def test_chained_tool_loop_on_one_connection(stack):
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "start", "tools": TOOLS, "generate": False, "store": False})
    await p.idle()
    prev = p.terminals()[-1]["id"]
    for turn in range(5):
        last = p.terminals()[-1]
        calls = [o for o in last["output"] if o["type"] == "function_call"]
        new = [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok"} for c in calls]
        new.append({"type": "message", "role": "user", "content": f"turn {turn}"})
        await p.frame({"type": "response.create", "previous_response_id": prev, "input": new, "tools": TOOLS,
                       "store": False})
        await p.idle()
        resp = p.terminals()[-1]
        assert resp["previous_response_id"] == prev and resp["status"] == "completed"
        prev = resp["id"]
    assert [j.mode for j in stack.render_jobs] == ["full"] + ["delta"] * 5
    assert "error" not in p.types()
    await p.session.shutdown()


async def test_failed_continuation_then_same_parent_is_not_found(stack):
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "read", "tools": TOOLS})
    await p.idle()
    parent = p.terminals()[-1]["id"]
    await p.frame({"type": "response.create", "previous_response_id": parent,
                   "input": [{"type": "function_call_output", "call_id": "wrong", "output": "x"}]})
    await p.frame({"type": "response.create", "previous_response_id": parent, "input": []})
    await p.idle()
    errors = [e for e in p.sent if e["type"] == "error"]
    assert errors[0]["error"]["message"] == "No tool call found for function call output with call_id wrong."
    assert errors[1]["error"]["code"] == "previous_response_not_found"
    await p.session.shutdown()


async def test_connection_time_limit_sends_error_and_closes(stack):
    p = Peer(stack, max_connection_seconds=0.3)
    await p.frame({"type": "response.create", "input": "hi"})
    await asyncio.sleep(0.8)
    assert p.sent[-1]["type"] == "error"
    assert p.sent[-1]["error"]["code"] == "websocket_connection_limit_reached"
    assert p.closed == 1000
    assert "response.completed" in p.types()  # the in-flight response was finished first
    await p.session.shutdown()


async def test_disconnect_cancels_generation(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=20)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "hi"})
    await asyncio.sleep(0.3)
    await p.session.shutdown()
    assert stack.engine.stats.aborted == 1
    assert "response.completed" not in p.types()


async def test_store_true_responses_are_published_store_false_are_not(stack):
    published = []
    p = Peer(stack, on_state=published.append)
    await p.frame({"type": "response.create", "input": "b", "store": False})
    await p.idle()
    assert not p.session.stored  # closing it may free the session's engine KV
    await p.frame({"type": "response.create", "input": "a"})
    await p.idle()
    stored = [s for s in published if s.store]
    assert len(stored) == 1 and stored[0].response_id == p.terminals()[1]["id"]
    assert p.session.stored  # another connection may continue it: its KV stays
    await p.session.shutdown()


async def test_idle_timeout_closes_only_an_idle_socket(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=20)  # a turn lasts longer than the idle timeout
    p = Peer(stack, idle_timeout_seconds=0.3)
    await p.frame({"type": "response.create", "input": "hi"})
    await asyncio.sleep(0.6)
    assert p.closed is None  # busy: a turn in flight is not idleness
    await p.idle()
    await asyncio.sleep(0.6)
    assert p.closed == 1000
    assert p.types()[-2] == "response.completed"
    assert p.sent[-1]["error"]["code"] == "websocket_connection_limit_reached"
    assert "without activity" in p.sent[-1]["error"]["message"]
    await p.session.shutdown()


async def test_drain_finishes_the_turn_in_flight_then_closes_1001(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=50)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "hi"})
    await asyncio.sleep(0.2)
    await p.session.drain()
    assert p.closed is None
    for _ in range(100):
        if p.closed:
            break
        await asyncio.sleep(0.05)
    assert p.closed == 1001
    assert p.types()[-2:] == ["response.completed", "error"]
    assert p.sent[-1]["error"]["code"] == "websocket_connection_limit_reached"
    await p.session.shutdown()


async def test_a_server_close_comes_only_after_the_last_response_is_stored(tokenizer):
    """The reconnect error sends the client to another replica, which reads its
    `previous_response_id` from the store: that write (post-work) must have landed first,
    and a store that hangs delays the close only by the settle bound."""
    from cluster.core.turn.post_work import PostWorkQueue

    stored, hung, peer = [], [], []  # peer[-1]: the client whose response is being stored

    async def persist(record):
        if hung:
            await asyncio.sleep(60)
        await asyncio.sleep(0.5)  # a slow store write, longer than the rest of the drain
        stored.append((record.response_id, "error" in peer[-1].types()))  # was the client told to go yet?

    queue = PostWorkQueue({"persist": persist})
    stack = InProcessStack(tokenizer, tokens_per_second=50, post_work=queue)
    p = Peer(stack, settle=lambda ids: queue.settle(ids, timeout=1.0))
    peer.append(p)
    await p.frame({"type": "response.create", "input": "hi"})
    await asyncio.sleep(0.2)
    await p.session.drain()
    for _ in range(100):
        if p.closed:
            break
        await asyncio.sleep(0.05)
    assert p.closed == 1001
    assert stored == [(p.terminals()[-1]["id"], False)]  # in the store before the client is told to go
    assert p.sent[-1]["error"]["code"] == "websocket_connection_limit_reached"

    hung.append(True)  # a store that never answers: the close waits for the bound, no longer
    p2 = Peer(stack, settle=lambda ids: queue.settle(ids, timeout=0.3))
    await p2.frame({"type": "response.create", "input": "hi"})
    await p2.idle()
    started = asyncio.get_running_loop().time()
    drain = asyncio.create_task(p2.session.drain())
    await asyncio.sleep(0.1)
    # Still settling: the socket's reader must not take the connection for closed and drop it
    # (before the error and close frame are out, the client would see the connection cut).
    assert not p2.session.closed and p2.closed is None
    await drain
    assert p2.closed == 1001 and p2.session.closed
    assert 0.25 < asyncio.get_running_loop().time() - started < 2

    # The connection's lifetime ending sends the client to reconnect as well: stored first too.
    hung.clear()
    stored.clear()
    p3 = Peer(stack, settle=lambda ids: queue.settle(ids, timeout=1.0), max_connection_seconds=0.3)
    peer.append(p3)
    await p3.frame({"type": "response.create", "input": "hi"})
    for _ in range(100):
        if p3.closed:
            break
        await asyncio.sleep(0.05)
    assert p3.closed == 1000 and p3.sent[-1]["error"]["code"] == "websocket_connection_limit_reached"
    assert stored == [(p3.terminals()[-1]["id"], False)]
    for s in (p.session, p2.session, p3.session):
        await s.shutdown()
    for task in list(queue._tasks):
        task.cancel()


async def test_too_many_input_items_is_a_400_and_the_socket_keeps_working(tokenizer):
    stack = InProcessStack(tokenizer)
    stack.driver.settings.max_input_items = 3
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": [{"role": "user", "content": "x"}] * 4})
    await p.frame({"type": "response.create", "input": [{"role": "user", "content": "x"}] * 3})
    await p.idle()
    err = p.sent[0]
    assert err["type"] == "error" and err["status"] == 400
    assert err["error"]["code"] == "array_above_max_length" and err["error"]["param"] == "input"
    assert p.types()[-1] == "response.completed"
    await p.session.shutdown()


async def test_context_token_limit(tokenizer):
    stack = InProcessStack(tokenizer)
    stack.driver.settings.max_context_tokens = 50
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "word " * 200})
    await p.frame({"type": "response.create", "input": "hi"})
    await p.idle()
    assert p.sent[0]["error"]["code"] == "context_length_exceeded"
    assert p.types()[-1] == "response.completed"
    await p.session.shutdown()


async def test_lanes_run_concurrently_each_fifo_and_waiting_creates_are_announced(tokenizer):
    """stream_id lanes: two lanes' responses interleave on the socket, never within a response;
    each lane is FIFO; a create behind another on its lane gets `response.queued` first, with the
    id its response then has; every event carries its lane's stream_id."""
    stack = InProcessStack(tokenizer, tokens_per_second=400)
    p = Peer(stack)
    for lane in ("a", "b"):
        for n in range(2):
            await p.frame({"type": "response.create", "input": f"{lane}{n}", "stream_id": lane, "store": False})
    await p.idle()
    by_lane = {lane: [e for e in p.all if e.get("stream_id") == lane] for lane in ("a", "b")}
    assert len(p.all) == len(by_lane["a"]) + len(by_lane["b"])  # every event names its lane
    for lane, events in by_lane.items():
        queued = [e for e in events if e["type"] == "response.queued"]
        assert len(queued) == 1  # the lane's second create waited behind its first
        done = [e["response"]["id"] for e in events if e["type"] == "response.completed"]
        assert len(done) == 2 and queued[0]["response"]["id"] == done[1]
        starts = [i for i, e in enumerate(events) if e["type"] == "response.created"]
        ends = [i for i, e in enumerate(events) if e["type"] == "response.completed"]
        assert starts[0] < ends[0] < starts[1] < ends[1]  # FIFO within the lane
        # each response's events count 0, 1, 2, ... once; the waiting one's from its `response.queued`
        seqs: dict[str, list[int]] = {}
        current = None
        for e in events:
            if e["type"] == "response.created":
                current = e["response"]["id"]
            rid = e["response"]["id"] if e["type"] == "response.queued" else current
            seqs.setdefault(rid, []).append(e["sequence_number"])
        assert sorted(seqs) == sorted(done) and all(v == list(range(len(v))) for v in seqs.values()), seqs
    # ... and the lanes ran at the same time: b's first response started before a's first ended
    order = [(e.get("stream_id"), e["type"]) for e in p.all]
    assert order.index(("b", "response.created")) < order.index(("a", "response.completed"))
    await p.session.shutdown()


async def test_lane_limits_and_bad_stream_ids(tokenizer):
    from cluster.core.websocket.protocol import MAX_ACTIVE, MAX_LANES

    stack = InProcessStack(tokenizer, tokens_per_second=200)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "x", "stream_id": "bad id!"})
    for n in range(MAX_LANES + 1):
        await p.frame({"type": "response.create", "input": f"q{n}", "stream_id": f"lane{n}", "store": False})
    await p.idle()
    errors = [e for e in p.sent if e["type"] == "error"]
    assert errors[0]["error"]["code"] == "invalid_stream_id"
    assert [e["error"]["code"] for e in errors[1:]] == ["websocket_stream_limit_reached"]
    assert errors[1]["stream_id"] == f"lane{MAX_LANES}"
    # 32 lanes, at most 16 responses at once: the rest were announced as queued
    assert len(p.queued) == MAX_LANES - MAX_ACTIVE
    assert len([e for e in p.sent if e["type"] == "response.completed"]) == MAX_LANES
    await p.session.shutdown()


async def test_interrupt_stops_the_response_discards_its_items_and_the_chain_continues(tokenizer):
    """Codex's `response.interrupt` (mode discard_partial_items) acts on the response in flight:
    it ends `incomplete` (reason `interrupted`) with no output — the acknowledgement Codex waits
    for — and can be continued; a late interrupt is ignored without disturbing the next turn."""
    stack = InProcessStack(tokenizer, tokens_per_second=50)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "tell me a long story", "store": False})
    for _ in range(200):
        if any(e["type"] == "response.output_text.delta" for e in p.sent):
            break
        await asyncio.sleep(0.02)
    rid = next(e["response"]["id"] for e in p.sent if e["type"] == "response.created")
    await p.frame({"type": "response.interrupt", "response_id": rid, "mode": "discard_partial_items"})
    await p.idle()
    end = p.sent[-1]
    assert end["type"] == "response.incomplete" and end["response"]["incomplete_details"] == {"reason": "interrupted"}
    assert end["response"]["output"] == [] and end["response"]["id"] == rid
    assert stack.engine.stats.aborted == 1  # the generation was stopped, not run to its end
    await p.frame({"type": "response.interrupt", "response_id": rid, "mode": "discard_partial_items"})  # late
    await p.frame({"type": "response.create", "input": "go on", "previous_response_id": rid, "store": False})
    await p.idle()
    assert p.sent[-1]["type"] == "response.completed" and p.sent[-1]["response"]["previous_response_id"] == rid
    assert not [e for e in p.sent if e["type"] == "error"]
    await p.frame({"type": "response.interrupt", "response_id": rid, "mode": "keep_partial_items"})
    await p.idle()
    assert p.sent[-1]["type"] == "error" and p.sent[-1]["error"]["param"] == "mode"
    await p.session.shutdown()


async def test_creates_waiting_on_lanes_stay_bounded(tokenizer):
    """Creates handed to lanes still count against max_queued_creates / max_queued_bytes until
    they start: a client cannot grow the server's memory by spreading creates over lanes."""
    stack = InProcessStack(tokenizer, tokens_per_second=100)
    p = Peer(stack, max_queued_creates=10, max_queued_bytes=64 * 1024)
    peak = 0
    for n in range(60):
        await p.frame({"type": "response.create", "input": f"q{n}", "stream_id": f"lane{n % 3}", "store": False})
        peak = max(peak, p.session.protocol.waiting_creates)
        await asyncio.sleep(0)
    assert peak <= 10
    refused = [e for e in p.sent if e["type"] == "error" and e["error"]["code"] == "rate_limit_exceeded"]
    assert refused  # the rest were refused at once, not held
    await p.idle()
    assert p.session.protocol.waiting_creates == 0 and p.session.protocol.queued_bytes == 0
    await p.session.shutdown()


async def test_a_fork_from_another_lane_waits_for_its_source_and_a_failed_fork_keeps_the_parent(tokenizer):
    """`store: false` forks across lanes: a create on lane B that continues a response lane A has
    not finished (running, or only announced by `response.queued`) waits for it instead of
    failing; a fork that fails leaves lane A's response continuable (a failed continuation on
    its own lane still evicts its parent)."""
    stack = InProcessStack(tokenizer, tokens_per_second=200)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "first", "stream_id": "a", "store": False})
    await p.frame({"type": "response.create", "input": "second", "stream_id": "a", "store": False})
    for _ in range(200):
        if p.queued and any(e["type"] == "response.created" for e in p.sent):
            break
        await asyncio.sleep(0.01)
    running = next(e["response"]["id"] for e in p.sent if e["type"] == "response.created")
    queued = p.queued[0]["response"]["id"]
    await p.frame({"type": "response.create", "input": "fork 1", "stream_id": "b", "store": False,
                   "previous_response_id": running})
    await p.frame({"type": "response.create", "input": "fork 2", "stream_id": "c", "store": False,
                   "previous_response_id": queued})
    await p.idle()
    assert not [e for e in p.sent if e["type"] == "error"], p.sent
    done = {r["previous_response_id"]: r for r in p.terminals()}
    assert done[running]["status"] == "completed" and done[queued]["status"] == "completed"
    # A fork's failure (a tool call left without output) keeps the source lane's response.
    await p.frame({"type": "response.create", "input": "read it", "tools": TOOLS, "stream_id": "a", "store": False})
    await p.idle()
    parent = p.terminals()[-1]["id"]
    await p.frame({"type": "response.create", "input": "no output", "stream_id": "b", "store": False,
                   "previous_response_id": parent})
    await p.idle()
    assert p.sent[-1]["type"] == "error" and "No tool output found" in p.sent[-1]["error"]["message"]
    assert parent in p.session.cache
    # The same failure on the parent's own lane evicts it (the rule for a chain's own next turn).
    await p.frame({"type": "response.create", "input": "no output", "stream_id": "a", "store": False,
                   "previous_response_id": parent})
    await p.idle()
    assert parent not in p.session.cache
    await p.session.shutdown()


async def test_interrupting_a_response_announced_as_queued_ends_it_when_its_turn_comes(tokenizer):
    stack = InProcessStack(tokenizer, tokens_per_second=100)
    p = Peer(stack)
    await p.frame({"type": "response.create", "input": "first", "stream_id": "a", "store": False})
    await p.frame({"type": "response.create", "input": "second: a long story", "stream_id": "a", "store": False})
    for _ in range(200):
        if p.queued:
            break
        await asyncio.sleep(0.01)
    rid = p.queued[0]["response"]["id"]
    await p.frame({"type": "response.interrupt", "response_id": rid, "mode": "discard_partial_items"})
    await p.idle()
    ends = {e["response"]["id"]: e for e in p.sent if e["type"] in ("response.completed", "response.incomplete")}
    assert ends[rid]["type"] == "response.incomplete"
    assert ends[rid]["response"]["incomplete_details"] == {"reason": "interrupted"}
    assert ends[rid]["response"]["output"] == []
    assert [e["type"] for e in ends.values()].count("response.completed") == 1  # the first ran as usual
    await p.session.shutdown()


async def test_large_creates_start_one_at_a_time_per_tenant_and_other_tenants_do_not_wait():
    """A tenant's large creates (frames over 64 KiB) take turns through the replica's
    gate across all its sockets; another tenant's create is not behind them."""
    from cluster.core.websocket.session import TenantGate

    gate = TenantGate()
    order: list[str] = []

    async def heavy(tenant: str, name: str, hold: float) -> None:
        release = await gate.enter(tenant)
        order.append(f"{name} in")
        await asyncio.sleep(hold)
        order.append(f"{name} out")
        release()

    await asyncio.gather(heavy("hostile", "h1", 0.05), heavy("hostile", "h2", 0.05), heavy("honest", "o1", 0.01))
    assert order.index("h2 in") > order.index("h1 out")  # the tenant's second waited for its first
    assert order.index("o1 in") < order.index("h1 out")  # the other tenant did not wait
    assert len(gate) == 0  # nothing kept for tenants with no create in flight
    waiter = asyncio.ensure_future(gate.enter("t"))
    release = await waiter
    cancelled = asyncio.ensure_future(gate.enter("t"))
    await asyncio.sleep(0)
    cancelled.cancel()
    release()
    await asyncio.sleep(0)
    assert len(gate) == 0  # a waiter cancelled while waiting leaves nothing behind


async def test_a_lane_of_creates_refused_at_once_lets_the_event_loop_go_between_them(stack):
    """Creates that fail before any engine call never suspend; a lane running a queue of them must
    still give the loop back between them (other sockets' turns waited 5 s behind one, measured)."""
    p = Peer(stack)
    for _ in range(20):
        await p.frame({"type": "response.create", "input": "hi", "background": True})  # each refused at once
    ticks: list[int] = []

    async def other_socket():
        while len(ticks) < 50:
            ticks.append(sum(1 for e in p.sent if e["type"] == "error"))
            await asyncio.sleep(0)

    other = asyncio.ensure_future(other_socket())
    await p.idle()
    other.cancel()
    assert sum(1 for e in p.sent if e["type"] == "error") == 20
    assert len(set(ticks[:20])) >= 10  # the other task ran between the lane's refusals, not after all of them
    await p.session.shutdown()


async def test_a_held_create_refused_when_it_starts_gets_its_error_and_the_lane_goes_on(tokenizer):
    """A large create that waits is read whole only when its lane starts it: its input's errors
    come then, in its place, and the creates behind it still run."""
    stack = InProcessStack(tokenizer, tokens_per_second=400)
    p = Peer(stack)
    deep: object = "a"
    for _ in range(80):
        deep = [deep]
    await p.frame({"type": "response.create", "input": "first"})
    await p.frame({"type": "response.create", "input": [{"role": "user", "content": "x" * 70_000}, deep]})
    await p.frame({"type": "response.create", "input": "third"})
    await p.idle()
    assert [e["type"] for e in p.sent if e["type"] in ("error", "response.completed")] == [
        "response.completed", "error", "response.completed"]
    [error] = [e for e in p.sent if e["type"] == "error"]
    assert error["error"]["code"] == "invalid_value" and error["status"] == 400
    assert p.closed is None
    await p.session.shutdown()


async def test_a_held_large_create_is_parsed_inside_its_tenants_gate(tokenizer, monkeypatch):
    """Sockets of one tenant whose lanes come free together parsed their held frames in one pass
    of the event loop (0.6 s stalls for every other socket, measured): the parse is part of the
    heavy start that goes through the tenant's gate."""
    from cluster.core.websocket.inflight import WsCreate
    from cluster.core.websocket.session import TenantGate

    gate = TenantGate()
    inside: list[bool] = []
    start_body = WsCreate.start_body

    def watched(self):
        if self.frame is not None:
            inside.append(gate._locks[""].locked())
        return start_body(self)

    monkeypatch.setattr(WsCreate, "start_body", watched)
    stack = InProcessStack(tokenizer, tokens_per_second=400)
    peers = [Peer(stack, heavy=gate) for _ in range(3)]
    for p in peers:
        await p.frame({"type": "response.create", "input": "first"})
        await p.frame({"type": "response.create", "input": [{"role": "user", "content": "a"}] * 10_000})
    for p in peers:
        await p.idle()
        assert [e["type"] for e in p.sent if e["type"] in ("response.completed", "error")][:1] == ["response.completed"]
        await p.session.shutdown()
    assert inside == [True, True, True]


async def test_a_client_that_reads_nothing_is_closed_though_a_send_to_it_is_stuck(stack, monkeypatch):
    """A client sent 200,000 invalid frames through HAProxy and never read; the
    socket stayed open. The errors' sends blocked (its buffers were full), and the 1008 close
    waited behind them for the socket's send lock (the route's, as here) for ever."""
    from cluster.core.websocket import session as module

    monkeypatch.setattr(module, "CLOSE_TIMEOUT_S", 1.0)  # the closing error's send is stuck too: 0.5 s, then the close
    lock, stuck = asyncio.Lock(), asyncio.Event()
    peer = Peer(stack)

    async def send(ev):
        async with lock:
            await stuck.wait()  # TCP and the ingress's buffers are full: never returns

    async def close(code, reason):
        async with lock:
            peer.closed = code

    peer.session._send, peer.session._close = send, close
    for _ in range(200):
        await asyncio.wait_for(peer.frame("x"), 5)
        if peer.session.closed:
            break
    assert peer.closed == 1008 and peer.session.closed
    assert all(t.done() for t in peer.session._lane_tasks.values())  # nothing left waiting on the client
