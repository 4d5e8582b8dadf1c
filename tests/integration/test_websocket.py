"""WebSocket mode against the real Serve app: the openai SDK and raw sockets."""

import asyncio
import json
import time

import openai
import pytest
from websockets.asyncio.client import connect

from tests.support.local_cluster import stats as server_stats
from tests.support.apps import SCRIPTED_ANSWER
from tests.support.ws import TERMINAL, ws_url
from tests.support.ws import sdk_turn as run_turn

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def test_sdk_twenty_turn_tool_loop_on_one_socket(scripted_url, client_for):
    client = client_for(scripted_url)
    per_turn = []
    with client.responses.connect() as conn:
        # Codex-style warm-up first, then chain on it with only new items.
        warm = run_turn(conn, model="loopserve-tiny", input="Fix the failing test in src/", tools=TOOLS,
                        instructions="You are a coding agent.", generate=False, store=False)
        assert [e.type for e in warm] == ["response.created", "response.in_progress", "response.completed"]
        prev = warm[-1].response
        new_items = []
        for turn in range(20):
            events = run_turn(conn, model="loopserve-tiny", previous_response_id=prev.id, input=new_items,
                              tools=TOOLS, instructions="You are a coding agent.", store=False)
            resp = events[-1].response
            assert resp.status == "completed", events[-1]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            per_turn.append((len(json.dumps(new_items)), resp.usage.input_tokens,
                             resp.usage.input_tokens_details.cached_tokens))
            calls = [o for o in resp.output if o.type == "function_call"]
            # The scripted model calls the tool after a user message, answers after a tool result.
            new_items = [{"type": "function_call_output", "call_id": c.call_id, "output": f"file {turn}\n" * 50}
                         for c in calls]
            new_items.append({"type": "message", "role": "user", "content": f"next step {turn}"})
            prev = resp
    # History grows, bytes sent per turn do not; every continuation reuses the cache.
    assert per_turn[-1][1] > 5 * per_turn[1][1]
    assert max(b for b, _, _ in per_turn[1:]) < 2 * min(b for b, _, _ in per_turn[1:])
    # (the warm-up does not touch the engine, so turn 0 is a cold prefill)
    assert all(cached > 0 for _, _, cached in per_turn[1:])
    stats = server_stats(scripted_url)
    assert stats["render"]["mismatches"] == 0


async def test_raw_socket_edge_cases_keep_the_connection_open(scripted_url):
    async with connect(ws_url(scripted_url), open_timeout=10, max_size=None,
                       additional_headers={"Authorization": "Bearer sk-test",
                                           "OpenAI-Beta": "responses_websockets=2026-02-06"}) as ws:
        assert "permessage-deflate" in ws.response.headers.get("Sec-WebSocket-Extensions", "")

        async def error():
            ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert ev["type"] == "error", ev
            return ev

        await ws.send("this is not json")
        assert (await error())["error"]["code"] == "invalid_json"
        await ws.send(json.dumps({"type": "session.update"}))
        assert (await error())["error"]["param"] == "type"
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "x",
                                  "previous_response_id": "resp_gone"}))
        ev = await error()
        assert ev["status"] == 400 and ev["error"]["code"] == "previous_response_not_found"
        assert ev["error"]["type"] == "invalid_request_error"
        await ws.send(json.dumps({"type": "response.create", "input": "y" * 300_000}))
        assert (await error())["error"]["code"] == "websocket_message_too_large"
        await ws.send(json.dumps({"type": "response.create", "input": "x", "background": True}))
        assert (await error())["error"]["param"] == "background"
        # ignored silently, then a real turn still works
        await ws.send(json.dumps({"type": "response.processed", "response_id": "x"}))
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi",
                                  "stream": True}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert first["type"] == "response.created"
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if ev["type"] in TERMINAL:
                break
        assert ev["type"] == "response.completed"


async def test_overlapping_creates_are_queued_fifo(scripted_url):
    async with connect(ws_url(scripted_url), open_timeout=10) as ws:
        for i in range(3):
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": f"q{i}"}))
        order = []
        while len([t for t in order if t in TERMINAL]) < 3:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 20))
            order.append(ev["type"])
            assert ev["type"] != "error", ev
        starts = [i for i, t in enumerate(order) if t == "response.created"]
        ends = [i for i, t in enumerate(order) if t in TERMINAL]
        assert starts[0] < ends[0] < starts[1] < ends[1] < starts[2] < ends[2]


async def test_disconnect_mid_stream_cancels_generation(scripted_url):
    before = server_stats(scripted_url)["engine"]["aborted"]
    async with connect(ws_url(scripted_url), open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "talk"}))
        while json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] != "response.output_text.delta":
            pass
    # the client is gone after the first delta: the engine must stop early
    for _ in range(50):
        after = server_stats(scripted_url)["engine"]["aborted"]
        if after > before:
            break
        await asyncio.sleep(0.1)
    assert after == before + 1
    # and a new connection is served normally
    async with connect(ws_url(scripted_url), open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi"}))
        types = []
        while not types or types[-1] not in TERMINAL:
            types.append(json.loads(await asyncio.wait_for(ws.recv(), 20))["type"])
        assert types[0] == "response.created" and types[-1] == "response.completed"


async def test_store_true_response_continues_on_a_new_socket(scripted_url):
    async with connect(ws_url(scripted_url), open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi"}))
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 20)))["type"] not in TERMINAL:
            pass
        rid = ev["response"]["id"]
    async with connect(ws_url(scripted_url), open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "more",
                                  "previous_response_id": rid}))
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 20)))["type"] not in TERMINAL + ("error",):
            pass
        assert ev["type"] == "response.completed", ev
        assert ev["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0


async def test_codex_0171_upgrade_header_and_create_fields(scripted_url):
    """Codex 0.171 reads the frame limit from the upgrade response and sends newer create
    fields; they are accepted (a warm-up with prompt_cache_options.prewarm, then a turn)."""
    async with connect(ws_url(scripted_url), additional_headers={"Authorization": "Bearer sk-test"},
                       open_timeout=20) as ws:
        assert ws.response.headers["x-codex-websocket-max-message-bytes"] == str(256 * 1024)
        extra = {"request_country": "FR", "stream_options": {"include_obfuscation": False},
                 "moderation": {"mode": "off"}, "access_programs": [], "stream": True,
                 "reasoning": {"context": "current_turn", "summary": "auto"}}
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                  "input": "Read the readme", "tools": TOOLS,
                                  "prompt_cache_options": {"mode": "implicit", "ttl": "30m", "prewarm": True},
                                  **extra}))
        types = []
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in TERMINAL + ("error",):
            types.append(ev["type"])
        assert ev["type"] == "response.completed" and ev["response"]["output"] == [], ev
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                  "previous_response_id": ev["response"]["id"], "input": "go on", "tools": TOOLS,
                                  **extra}))
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in TERMINAL + ("error",):
            pass
        assert ev["type"] == "response.completed" and ev["response"]["output"][0]["type"] == "function_call", ev


async def test_codex_timing_metrics_on_request(scripted_url):
    """With `x-responsesapi-include-timing-metrics` on the upgrade, each turn sends Codex's
    `responsesapi.websocket_timing` event right before its terminal event; without it, none."""
    for asked in (True, False):
        headers = {"Authorization": "Bearer sk-test"}
        if asked:
            headers["x-responsesapi-include-timing-metrics"] = "true"
        async with connect(ws_url(scripted_url), additional_headers=headers, open_timeout=20) as ws:
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                      "input": "Read the readme", "tools": TOOLS}))
            events = []
            while (ev := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in TERMINAL + ("error",):
                events.append(ev)
            timing = [e for e in events if e["type"] == "responsesapi.websocket_timing"]
            if not asked:
                assert timing == []
                continue
            assert events[-1]["type"] == "responsesapi.websocket_timing" and len(timing) == 1
            metrics = timing[0]["timing_metrics"]
            assert set(metrics) == {"responses_duration_excl_engine_and_client_tool_time_ms", "engine_service_total_ms",
                                    "engine_iapi_ttft_total_ms", "engine_service_ttft_total_ms",
                                    "engine_iapi_tbt_across_engine_calls_ms",
                                    "engine_service_tbt_across_engine_calls_ms"}
            assert all(isinstance(v, int) and v >= 0 for v in metrics.values())
            assert metrics["engine_service_total_ms"] > 0  # the scripted engine decodes at 100 tokens/s


async def test_stream_id_lanes_run_concurrently(scripted_url):
    """Two lanes on one socket: their responses run at the same time (events interleave on the
    socket, never within a response), each lane stays FIFO, a create waiting on its lane is
    announced with `response.queued`, and every event names its lane."""
    async with connect(ws_url(scripted_url), open_timeout=20) as ws:
        for n in range(2):
            for lane in ("left", "right"):
                await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                          "input": f"{lane} question {n}", "stream_id": lane}))
        events = []
        while len([e for e in events if e["type"] in TERMINAL]) < 4:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert ev["type"] != "error", ev
            events.append(ev)
    assert all(e.get("stream_id") in ("left", "right") for e in events)
    for lane in ("left", "right"):
        mine = [e for e in events if e["stream_id"] == lane]
        kinds = [e["type"] for e in mine]
        assert kinds.count("response.queued") == 1 and kinds.count("response.completed") == 2
        first_done = kinds.index("response.completed")
        assert kinds.index("response.created", first_done) > first_done  # FIFO on the lane
        ids = [e["response"]["id"] for e in mine if e["type"] in ("response.queued", "response.completed")]
        assert ids[0] == ids[-1] or ids.count(ids[0]) == 2  # the queued one is the lane's second response
    order = [(e["stream_id"], e["type"]) for e in events]
    assert order.index(("right", "response.created")) < order.index(("left", "response.completed"))


async def test_codex_interrupt_over_a_real_socket(scripted_url):
    """Codex's `response.interrupt`: the response in flight stops and ends `incomplete`
    (reason `interrupted`, no output); the chain continues from it; a late interrupt is ignored."""
    from tests.support.apps import LONG_ONE

    async with connect(ws_url(scripted_url), open_timeout=20) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                  "input": f"please give the {LONG_ONE}"}))
        rid = None
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if ev["type"] == "response.created":
                rid = ev["response"]["id"]
            if ev["type"] == "response.output_text.delta":
                break
        await ws.send(json.dumps({"type": "response.interrupt", "response_id": rid, "mode": "discard_partial_items"}))
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in TERMINAL + ("error",):
            pass
        assert ev["type"] == "response.incomplete", ev
        assert ev["response"]["incomplete_details"]["reason"] == "interrupted" and ev["response"]["output"] == []
        await ws.send(json.dumps({"type": "response.interrupt", "response_id": rid, "mode": "discard_partial_items"}))
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                  "previous_response_id": rid, "input": "short answer now"}))
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in TERMINAL + ("error",):
            assert ev["type"] != "error", ev
        # (the context still asks for the long one: the scripted engine answers it at length)
        assert ev["type"] in ("response.completed", "response.incomplete"), ev
        assert ev["response"]["previous_response_id"] == rid and ev["response"]["output"]


def test_sdk_steer_stops_the_response_and_a_successor_commits_the_input(scripted_url, client_for):
    """`conn.response.steer(...)` from the openai SDK while a response streams: accepted, the
    response ends incomplete (steered) with what it said so far, and the automatic successor
    continues it with the steering input (stored: its input items show the steer)."""
    client = client_for(scripted_url)
    with client.responses.connect() as conn:
        conn.response.create(model="loopserve-tiny", input="Explain the change", store=True, max_output_tokens=128)
        events, rid, steered = [], None, False
        for event in conn:
            events.append(event)
            if event.type == "response.created" and rid is None:
                rid = event.response.id
            if event.type == "response.output_text.delta" and not steered:
                conn.response.steer(previous_response_id=rid, input="Only list the files you changed.")
                steered = True
            if event.type == "response.completed":
                break
            assert event.type != "error", event
        kinds = [e.type for e in events]
        assert kinds.count("response.steer.accepted") == 1 and kinds.count("response.created") == 2
        accepted = events[kinds.index("response.steer.accepted")]
        assert accepted.steer.previous_response_id == rid
        incomplete = events[kinds.index("response.incomplete")].response
        assert incomplete.id == rid and incomplete.incomplete_details.reason == "steered"
        assert 0 < len(incomplete.output[0].content[0].text) < len(SCRIPTED_ANSWER)
        successor = events[-1].response
        assert successor.previous_response_id == rid and successor.status == "completed"
        # A steer for a response that has ended fails and returns its input; the socket carries on.
        conn.response.steer(previous_response_id=successor.id, input="too late")
        failed = next(iter(conn))
        assert failed.type == "response.steer.failed" and failed.error.code == "response_already_completed"
        assert failed.steer.input == "too late"
        assert run_turn(conn, model="loopserve-tiny", input="thanks", previous_response_id=successor.id,
                        store=False)[-1].type == "response.completed"
    # The successor's input is the steering message (it went through the store like any input).
    for _ in range(100):
        try:
            items = client.responses.input_items.list(successor.id)
            break
        except Exception:  # noqa: BLE001 - persisted after the terminal event
            time.sleep(0.1)
    texts = [c.text for item in items.data if getattr(item, "role", None) == "user" for c in item.content]
    assert texts == ["Only list the files you changed."]


async def test_a_store_false_fork_across_lanes(scripted_url):
    """A lane that continues another lane's `store: false` response, sent while that response
    is only announced (`response.queued`): it waits for it and continues it; a fork that fails
    leaves the source response continuable on its own lane."""
    async with connect(ws_url(scripted_url), open_timeout=20) as ws:
        async def create(**body):
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False, **body}))

        await create(input="first", stream_id="main")
        await create(input="second", stream_id="main")
        events = []
        while not any(e["type"] == "response.queued" for e in events):
            events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        source = next(e for e in events if e["type"] == "response.queued")["response"]["id"]
        await create(input="fork", stream_id="side", previous_response_id=source)
        while len([e for e in events if e["type"] in TERMINAL]) < 3:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert ev["type"] != "error", ev
            events.append(ev)
        fork = next(e for e in events if e["type"] in TERMINAL and e["stream_id"] == "side")["response"]
        assert fork["status"] == "completed" and fork["previous_response_id"] == source
        # A fork that fails (bad input for that parent) keeps the source response for its own lane.
        await create(stream_id="side", previous_response_id=source,
                     input=[{"type": "function_call_output", "call_id": "call_unknown", "output": "x"}])
        ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert ev["type"] == "error" and ev["stream_id"] == "side", ev
        await create(stream_id="main", previous_response_id=source, input="go on")
        while (ev := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in TERMINAL + ("error",):
            pass
        assert ev["type"] == "response.completed" and ev["response"]["previous_response_id"] == source, ev


def test_sdk_beta_multi_agent_response_takes_injected_tool_outputs(scripted_url, client_for):
    """The SDK's beta connection (`OpenAI-Beta: responses_multi_agent=v1`): a multi-agent response
    calls a tool and waits; `conn.response.inject(...)` commits the output
    (`response.inject.created`) and the same response goes on to its answer."""
    client = client_for(scripted_url)
    with client.beta.responses.connect(extra_headers={"OpenAI-Beta": "responses_multi_agent=v1"}) as conn:
        conn.response.create(model="loopserve-tiny", input="Read the config", tools=TOOLS, store=False,
                             multi_agent={"enabled": True})
        kinds, rid, final = [], None, None
        for event in conn:
            kinds.append(event.type)
            assert event.type != "error", event
            if event.type == "response.created":
                rid = event.response.id
            if event.type == "response.output_item.done" and event.item.type == "function_call":
                conn.response.inject(response_id=rid, input=[
                    {"type": "function_call_output", "call_id": event.item.call_id, "output": "debug = true"}])
            if event.type == "response.completed":
                final = event.response
                break
        assert "response.inject.created" in kinds and kinds.count("response.created") == 1
        assert final.id == rid and [o.type for o in final.output] == ["function_call", "function_call_output",
                                                                       "message"]
        assert final.output[2].content[0].text == SCRIPTED_ANSWER
    # Over HTTP nothing could inject the outputs: refused in the API's error shape.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="loopserve-tiny", input="hi", extra_body={"multi_agent": {"enabled": True}})
    assert e.value.body["param"] == "multi_agent" and e.value.body["code"] == "unsupported_value"
