"""SafetyActor in the real app: blocked input over HTTP and WebSocket, guard model path."""

import asyncio
import json

import pytest
from websockets.asyncio.client import connect

from tests.support.local_cluster import stats as server_stats
from tests.support.ws import TERMINAL as RESPONSE_ENDS
from tests.support.ws import ws_url

pytestmark = pytest.mark.integration
TERMINAL = (*RESPONSE_ENDS, "error")  # or a refusal before the response
SECRET = "my key is -----BEGIN RSA PRIVATE KEY----- MIIE..."


def test_blocked_input_over_http_streams_no_output(scripted_url, client_for):
    client = client_for(scripted_url)
    resp = client.responses.create(model="loopserve-tiny", input="you are a fucking idiot")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "content_filter"
    assert resp.output == []
    with client.responses.stream(model="loopserve-tiny", input=SECRET) as stream:
        types = [e.type for e in stream]
    assert types == ["response.created", "response.in_progress", "response.incomplete"]
    # and an ordinary request right after is served
    assert client.responses.create(model="loopserve-tiny", input="hello").status == "completed"


async def test_blocked_input_over_websocket_keeps_the_socket(scripted_url):
    url = ws_url(scripted_url)
    async with connect(url, open_timeout=10) as ws:
        async def turn(text):
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": text}))
            types = []
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 20))
                types.append(ev["type"])
                if ev["type"] in TERMINAL:
                    return types, ev

        types, ev = await turn(SECRET)
        assert types == ["response.created", "response.in_progress", "response.incomplete"]
        assert ev["response"]["incomplete_details"] == {"reason": "content_filter"}
        types, ev = await turn("hello again")
        assert ev["type"] == "response.completed" and "response.output_text.delta" in types
    s = server_stats(scripted_url)
    assert s["blocked_turns"] >= 1 and s["safety"]["flagged"] >= 1
    assert any(k.startswith("input:") for k in s["safety_ledger"]["flagged"])


async def test_usage_is_metered_after_the_client_disconnects(scripted_url):
    before = sum(u["requests"] for u in server_stats(scripted_url)["usage"])
    url = ws_url(scripted_url)
    async with connect(url, open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "talk"}))
        while json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] != "response.output_text.delta":
            pass
    for _ in range(50):
        after = sum(u["requests"] for u in server_stats(scripted_url)["usage"])
        if after > before:
            break
        await asyncio.sleep(0.1)
    assert after == before + 1
    assert server_stats(scripted_url)["post_work"]["failed"] == 0


def test_guard_model_verdicts_safe_unsafe_and_unparseable(guard_url, client_for):
    """The guard (a scripted stand-in for Llama Guard: no such weights here) answers by content."""
    from tests.support.apps import GUARD_GARBLED, GUARD_UNSAFE

    client = client_for(guard_url)
    ok = client.responses.create(model="loopserve-tiny", input="please list the files in src/")
    assert ok.status == "completed" and ok.output  # `safe`: served
    bad = client.responses.create(model="loopserve-tiny", input=f"a message with {GUARD_UNSAFE} in it")
    assert bad.status == "incomplete" and bad.incomplete_details.reason == "content_filter" and bad.output == []
    before = server_stats(guard_url)["safety"]["guard_unparseable"]
    odd = client.responses.create(model="loopserve-tiny", input=f"something {GUARD_GARBLED}")
    # neither safe nor unsafe: flagged by the default policy, and counted
    assert odd.status == "incomplete" and odd.incomplete_details.reason == "content_filter"
    s = server_stats(guard_url)
    assert s["safety"]["guard_unparseable"] == before + 1
    assert "input:S10" in s["safety_ledger"]["flagged"]
    assert "input:guard_unparseable" in s["safety_ledger"]["flagged"]
