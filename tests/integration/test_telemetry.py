"""Traces and metrics of a real Serve app, received by an OTLP/HTTP receiver on 127.0.0.1."""

import asyncio
import json
import secrets

import httpx
import pytest
from websockets.asyncio.client import connect

from cluster import telemetry
from cluster.protocol.ids import session_key
from tests.support.ws import ws_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


async def ws_loop(url: str, turns: int, headers: dict) -> list[str]:
    ids = []
    async with connect(ws_url(url), additional_headers=headers,
                       open_timeout=30, close_timeout=5) as ws:
        prev, items = None, [{"type": "message", "role": "user", "content": "Read the readme and fix the bug."}]
        for i in range(turns):
            body = {"type": "response.create", "model": "loopserve-tiny", "tools": TOOLS, "input": items}
            if prev:
                body["previous_response_id"] = prev
            await ws.send(json.dumps(body))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if ev["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
                    break
            assert ev["type"] == "response.completed", ev
            resp = ev["response"]
            ids.append(resp["id"])
            prev = resp["id"]
            call = next(o for o in resp["output"] if o["type"] == "function_call")
            items = [{"type": "function_call_output", "call_id": call["call_id"], "output": f"file {i}"},
                     {"type": "message", "role": "user", "content": f"step {i}: continue"}]
    return ids


async def test_websocket_turn_is_one_trace_tree_across_processes(otel_url, otlp_receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    ids = await ws_loop(otel_url, 2, {"traceparent": f"00-{trace_id}-{client_span}-01",
                                      "x-session-id": "session-otel-1"})

    def turn_spans(r):
        return [s for s in r.spans if s["trace_id"] == trace_id]

    def complete(r):
        names = {s["name"] for s in turn_spans(r)}
        return {"response.create", "render.execute", "safety.classify", "engine.generate", "engine.prefill",
                "engine.decode", "engine.queue_wait", "post_work.persist"} <= names and \
            sum(s["name"] == "response.create" for s in turn_spans(r)) == 2

    assert otlp_receiver.wait_for(complete, timeout=30), sorted({s["name"] for s in turn_spans(otlp_receiver)})
    spans = turn_spans(otlp_receiver)
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if s["name"] == "response.create"]
    # The upgrade's traceparent is honoured: each turn hangs under the client's span.
    assert {r["parent_id"] for r in roots} == {client_span}
    assert {r["attributes"]["loopserve.response_id"] for r in roots} == set(ids)

    def root_of(s):
        while s["name"] != "response.create":
            s = by_id[s["parent_id"]]  # KeyError = a broken tree
        return s

    first = next(r for r in roots if r["attributes"]["loopserve.response_id"] == ids[0])
    tree = [s for s in spans if root_of(s) is first]
    roles = {s["resource"]["loopserve.role"] for s in tree}
    assert {"connection", "render", "safety", "engine"} <= roles, roles
    assert len({s["resource"]["process.pid"] for s in tree}) >= 4
    names = {s["name"] for s in tree}
    for expected in ("parse", "resolve_context", "render", "render.execute", "safety.input", "safety.classify",
                     "engine", "engine.generate", "engine.queue_wait", "engine.prefill", "engine.decode",
                     "stream_events"):
        assert expected in names, (expected, sorted(names))
    # Remote spans hang under the local span that made the call.
    parent_name = {s["name"]: by_id[s["parent_id"]]["name"] for s in tree if s["parent_id"] in by_id}
    parents = {by_id[s["parent_id"]]["name"] for s in tree if s["name"] == "safety.classify"}
    assert parent_name["render.execute"] == "render"
    # the input check, and (after the terminal event) the generated tool-call arguments
    assert parents == {"safety.input", "post_work.output_safety"}, parents
    assert parent_name["engine.generate"] == "engine"
    assert parent_name["engine.prefill"] == "engine.generate"
    gen = next(s for s in tree if s["name"] == "engine.generate")
    assert gen["attributes"]["gen_ai.response.time_to_first_token_ms"] > 0
    # the session key as the server holds it (a digest of the tenant's x-session-id, made at the edge), hashed again
    assert first["attributes"]["loopserve.session"] == telemetry.hash_key(session_key("session-otel-1", "default"))
    second = next(r for r in roots if r is not first)
    assert second["attributes"]["loopserve.cache"] == "hit"
    assert second["attributes"]["loopserve.cached_tokens"] > 0


async def test_http_traceparent_is_honoured_and_each_turn_otherwise_gets_its_own_trace(otel_url, otlp_receiver):
    trace_id = secrets.token_hex(16)
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(otel_url + "/v1/responses", json={"model": "loopserve-tiny", "input": "hello"},
                              headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        assert r.status_code == 200
        rid = r.json()["id"]
        r2 = await client.post(otel_url + "/v1/responses", json={"model": "loopserve-tiny", "input": "hello again"})
        rid2 = r2.json()["id"]

    def roots(r):
        return {s["attributes"].get("loopserve.response_id"): s for s in r.spans if s["name"] == "response.create"}

    assert otlp_receiver.wait_for(lambda r: {rid, rid2} <= set(roots(r)), timeout=30)
    found = roots(otlp_receiver)
    assert found[rid]["trace_id"] == trace_id
    assert found[rid2]["trace_id"] != trace_id and found[rid2]["parent_id"] == ""
    assert found[rid]["attributes"]["loopserve.transport"] == "http"


async def test_metrics_are_exported_and_move_under_load(otel_url, otlp_receiver):
    def latest(name, **attrs):
        points = [m for m in otlp_receiver.metrics if m["name"] == name
                  and all(m["attributes"].get(k) == v for k, v in attrs.items())]
        return points[-1]["value"] if points else 0

    await ws_loop(otel_url, 1, {})
    assert otlp_receiver.wait_for(lambda r: latest("loopserve.turns", transport="websocket", status="completed") > 0,
                                  timeout=30)
    before = latest("loopserve.turns", transport="websocket", status="completed")
    await asyncio.gather(*[ws_loop(otel_url, 3, {}) for _ in range(4)])
    assert otlp_receiver.wait_for(
        lambda r: latest("loopserve.turns", transport="websocket", status="completed") >= before + 12, timeout=30)
    names = {m["name"] for m in otlp_receiver.metrics}
    for expected in ("loopserve.turn.overhead", "loopserve.turn.ttft", "loopserve.tokens.output",
                     "loopserve.session_cache.lookups", "loopserve.session_cache.bytes",
                     "loopserve.connections.active", "loopserve.engine.queue_depth", "loopserve.tokens.per_second"):
        assert expected in names, (expected, sorted(names))
    assert latest("loopserve.session_cache.lookups", result="hit") >= 8
    assert latest("loopserve.turn.overhead") >= 12  # histogram: number of turns observed
    # every socket closed again (an export may have been taken while the last ones were closing)
    assert otlp_receiver.wait_for(lambda r: latest("loopserve.connections.active") == 0, timeout=30)
