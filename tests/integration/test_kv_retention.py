"""KV retention on the real engine: a paused WebSocket session's prefix survives other sessions'
traffic that evicts an unretained one, and a closed `store: false` socket frees its budget."""

import secrets
import time

import pytest

from cluster.bench.local import admin_headers
from tests.support.ws import sdk_response, turn, ws_url

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

BLOCKS = 72  # x 32 tokens: a 2,304-token KV pool (a 2,048-token context fits), so a few prompts fill it


@pytest.fixture(scope="module")
def small_kv_url(serve_instance, tmp_path_factory):
    pytest.importorskip("vllm")
    from tests.support.apps import module_app

    args = {
        "model": {"max_model_len": 2048},
        "store": {"backend": "sqlite", "sqlite_path": str(tmp_path_factory.mktemp("kvstore") / "r.db")},
        "engine": {"backend": "vllm", "vllm": {"block_size": 32, "default_max_tokens": 8, "cpu_kvcache_space_gib": 1,
                                               "num_gpu_blocks_override": BLOCKS},
                   "kv_budget": {"ttl_initial_s": 120, "max_queue_wait_s": 60}},
        "safety": {"enabled": False},
        "connection": {"ray_actor_options": {"num_cpus": 0.1}}, "render": {"ray_actor_options": {"num_cpus": 0.1}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.5}},
    }
    yield from module_app("smallkv", "/smallkv", args, serve_instance, 400)


def _text(tag: str) -> str:
    return (f"[{tag}] the tool printed: tests/test_mod.py::case failed at line 12 with a KeyError. " * 20)[:1500]


def _kv(client_url: str) -> dict:
    import httpx

    r = httpx.get(client_url + "/loopserve/stats", headers=admin_headers(), timeout=30)
    r.raise_for_status()
    return r.json()["engine"]["kv"]


def test_a_paused_session_keeps_its_prefix_while_traffic_evicts_an_unretained_one(small_kv_url, client_for):
    client = client_for(small_kv_url)
    run = secrets.token_hex(4)
    assert _kv(small_kv_url)["capacity_tokens"] == BLOCKS * 32
    with client.responses.connect() as conn:
        a1 = sdk_response(conn, model="loopserve-tiny", input=_text(f"{run}-A1"), store=False, max_output_tokens=8)
        # The control: an HTTP session (not expected back: no socket, no tool calls), stored.
        k1 = client.responses.create(model="loopserve-tiny", input=_text(f"{run}-K1"), max_output_tokens=8)
        kv = _kv(small_kv_url)
        assert kv["retained_sessions"] == 1 and kv["retained_tokens"] >= a1.usage.input_tokens
        # Other sessions' traffic: more tokens than the pool minus A's retained prefix.
        for i in range(5):
            client.responses.create(model="loopserve-tiny", input=_text(f"{run}-T{i}"), max_output_tokens=8,
                                    store=False)
        k2 = client.responses.create(model="loopserve-tiny", input="and then?", previous_response_id=k1.id,
                                     max_output_tokens=8)
        a2 = sdk_response(conn, model="loopserve-tiny", input="and then?", previous_response_id=a1.id, store=False,
                          max_output_tokens=8)
    # The unretained prefix went with the traffic; the retained one is all still there.
    assert k2.usage.input_tokens_details.cached_tokens < k1.usage.input_tokens // 2
    assert a2.usage.input_tokens_details.cached_tokens >= (a1.usage.input_tokens // 32) * 32 - 32
    # The socket closed with nothing stored: A's budget is released at once (well before its TTL).
    deadline = time.time() + 30
    while time.time() < deadline:
        kv = _kv(small_kv_url)
        if kv["retained_tokens"] == 0:
            break
        time.sleep(0.5)
    assert kv["retained_tokens"] == 0 and kv["released"] >= 1
    assert kv["preemptions"] == 0


@pytest.fixture(scope="module")
def scripted_kv_url(serve_instance):
    """The scripted engine with a modelled 1,024-token KV pool (a stand-in for vLLM's block pool)."""
    from tests.support.apps import module_app, scripted_app

    args = scripted_app({"kv_capacity_tokens": 1024, "kv_block_size": 32, "tokens_per_second": 500,
                         "answer_text": "done.", "max_output_tokens": 8}, safety={"enabled": False})
    args["engine"]["kv_budget"] = {"ttl_initial_s": 120, "max_queue_wait_s": 120}
    yield from module_app("scriptedkv", "/scriptedkv", args, serve_instance, 240)


async def _turn(ws, text: str, prev=None) -> list[dict]:
    body = {"input": text, "store": False, "max_output_tokens": 8}
    if prev:
        body["previous_response_id"] = prev
    return await turn(ws, body, timeout=120)


async def test_a_turn_waiting_for_kv_is_queued_visibly_and_starts_when_a_closed_socket_releases_its_session(
        scripted_kv_url):
    import asyncio

    from websockets.asyncio.client import connect

    url = ws_url(scripted_kv_url)
    run = secrets.token_hex(4)
    async with asyncio.timeout(120):
        a = await connect(url)
        first = await _turn(a, _text(f"{run}-A"))
        assert first[-1]["type"] == "response.completed"
        assert first[-1]["response"]["usage"]["input_tokens"] > 400  # A's retained prefix: over 40% of the pool
        async with connect(url) as b:
            waiting = asyncio.ensure_future(_turn(b, _text(f"{run}-B")))
            await asyncio.sleep(3)
            assert not waiting.done()  # B's turn does not fit beside A's retained prefix
            assert _kv(scripted_kv_url)["queued_turns"] == 1
            await a.close()  # A's socket closes with nothing stored: its prefix is released at once
            events = await waiting
        types = [e["type"] for e in events]
        assert types[:3] == ["response.created", "response.in_progress", "response.queued"]
        assert events[2]["response"]["status"] == "queued"
        assert types[3] == "response.in_progress" and types[-1] == "response.completed"
    kv = _kv(scripted_kv_url)
    assert kv["released"] >= 1 and kv["waited"] >= 1 and kv["preemptions"] == 0
