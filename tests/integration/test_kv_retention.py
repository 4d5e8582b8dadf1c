"""KV retention on the real engine: a paused session's prefix survives other sessions' traffic that
evicts an unretained one, whatever carries the session (a held WebSocket, HTTP chained by
`previous_response_id`); a declared `prompt_cache_options.ttl` outlives the default retention; a
closed `store: false` socket frees its budget."""

import json
import secrets
import time

import pytest

from cluster.core.messages import Generation
from tests.support.local_cluster import admin_headers
from tests.support.ws import sdk_response, turn, ws_url

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

BLOCKS = 72  # x 32 tokens: a 2,304-token KV pool (a 2,048-token context fits), so a few prompts fill it
TTL_INITIAL_S = 15  # the retention of a session whose pauses are not known yet


@pytest.fixture(scope="module")
def small_kv_url(serve_instance, tmp_path_factory):
    pytest.importorskip("vllm")
    from tests.support.apps import module_app

    args = {
        "model": {"max_model_len": 2048},
        "store": {"backend": "sqlite", "sqlite_path": str(tmp_path_factory.mktemp("kvstore") / "r.db")},
        "engine": {"backend": "vllm", "vllm": {"block_size": 32, "default_max_tokens": 8, "cpu_kvcache_space_gib": 1,
                                               "num_gpu_blocks_override": BLOCKS},
                   "kv_budget": {"ttl_initial_s": TTL_INITIAL_S, "max_queue_wait_s": 60}},
        "safety": {"enabled": False},
        "connection": {"ray_actor_options": {"num_cpus": 0.1}}, "render": {"ray_actor_options": {"num_cpus": 0.1}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.5}},
    }
    yield from module_app("smallkv", "/smallkv", args, serve_instance, 400)


def _text(tag: str, chars: int = 1500) -> str:
    """`chars` of a tool's output (the tiny model's tokenizer: ~1.6 characters a token)."""
    return (f"[{tag}] the tool printed: tests/test_mod.py::case failed at line 12 with a KeyError. " * 40)[:chars]


# A session's prompt in the tests below: ~500 tokens, so two retained sessions and a turn of
# traffic fit the 2,304-token pool, and five turns of traffic do not fit beside them.
SHORT = 800


def _kv(client_url: str) -> dict:
    import httpx

    r = httpx.get(client_url + "/loopserve/stats", headers=admin_headers(), timeout=30)
    r.raise_for_status()
    return r.json()["engine"]["kv"]


def _traffic(client, run: str, n: int = 5) -> None:
    """Other sessions' turns: more tokens than the pool minus what is retained (`store: false` over
    HTTP: not continuable, nothing of them is kept)."""
    for i in range(n):
        client.responses.create(model="loopserve-tiny", input=_text(f"{run}-T{i}", SHORT), max_output_tokens=8,
                                store=False)


def _kept(first, then) -> bool:
    """`then` reused all of `first`'s prompt (whole blocks of 32, the last one computed again)."""
    return then.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens // 32) * 32 - 32


def test_paused_sessions_keep_their_prefix_over_any_transport_while_traffic_evicts_an_unretained_one(
        small_kv_url, client_for):
    client = client_for(small_kv_url)
    run = secrets.token_hex(4)
    assert _kv(small_kv_url)["capacity_tokens"] == BLOCKS * 32
    with client.responses.connect() as conn:
        a1 = sdk_response(conn, model="loopserve-tiny", input=_text(f"{run}-A1", SHORT), store=False, max_output_tokens=8)
        # An HTTP chain (the SDK's default: stored, continued by id): no socket, no tool calls.
        h1 = client.responses.create(model="loopserve-tiny", input=_text(f"{run}-H1", SHORT), max_output_tokens=8)
        # The control: a stateless client (`store: false`, its history resent): nothing can continue it.
        c1 = client.responses.create(model="loopserve-tiny", input=_text(f"{run}-C1", SHORT), max_output_tokens=8,
                                     store=False)
        kv = _settled(small_kv_url, lambda kv: kv["retained_sessions"] == 2)  # (a turn's end reaches the budget
        assert kv["retained_tokens"] >= a1.usage.input_tokens + h1.usage.input_tokens  # just after the client's)
        _traffic(client, run)
        c2 = client.responses.create(model="loopserve-tiny", input=[
            {"role": "user", "content": _text(f"{run}-C1", SHORT)}, {"role": "assistant", "content": c1.output_text},
            {"role": "user", "content": "and then?"}], max_output_tokens=8, store=False)
        h2 = client.responses.create(model="loopserve-tiny", input="and then?", previous_response_id=h1.id,
                                     max_output_tokens=8)
        a2 = sdk_response(conn, model="loopserve-tiny", input="and then?", previous_response_id=a1.id, store=False,
                          max_output_tokens=8)
    # The unretained prefix went with the traffic; the retained ones are all still there.
    assert c2.usage.input_tokens_details.cached_tokens < c1.usage.input_tokens // 2
    assert _kept(a1, a2) and _kept(h1, h2)
    # The socket closed with nothing stored: A's budget is released at once (well before its TTL).
    kv = _settled(small_kv_url, lambda kv: kv["released"] >= 1)
    assert kv["preemptions"] == 0


def _settled(url: str, ok, timeout: float = 30) -> dict:
    """The replica's KV figures once `ok` holds (asserted by the deadline)."""
    deadline = time.time() + timeout
    while True:
        kv = _kv(url)
        if ok(kv) or time.time() > deadline:
            assert ok(kv), json.dumps(kv)
            return kv
        time.sleep(0.2)


def test_a_declared_ttl_keeps_the_prefix_past_the_default_retention(small_kv_url, client_for):
    from openai.types.responses import Response

    client = client_for(small_kv_url)
    run = secrets.token_hex(4)
    plain = client.responses.create(model="loopserve-tiny", input=_text(f"{run}-P", SHORT), max_output_tokens=8)
    declared = client.responses.create(model="loopserve-tiny", input=_text(f"{run}-D", SHORT), max_output_tokens=8,
                                       extra_body={"prompt_cache_options": {"ttl": "30m"}})
    assert isinstance(declared, Response) and declared.prompt_cache_options.ttl == "30m"
    time.sleep(TTL_INITIAL_S + 1)  # past the default retention of a session whose pauses are unknown
    _traffic(client, run)
    p2 = client.responses.create(model="loopserve-tiny", input="and then?", previous_response_id=plain.id,
                                 max_output_tokens=8)
    d2 = client.responses.create(model="loopserve-tiny", input="and then?", previous_response_id=declared.id,
                                 max_output_tokens=8, extra_body={"prompt_cache_options": {
                                     "ttl": "30m", "comparison_response_id": declared.id}})
    assert p2.usage.input_tokens_details.cached_tokens < plain.usage.input_tokens // 2
    assert _kept(declared, d2) and d2.prompt_cache_diagnostics.type == "cache_hit"
    kv = _kv(small_kv_url)
    assert kv["pins_enabled"] == 1 and kv["pins_off_reason"] == "" and kv["prefill_tokens_per_s"] > 0


@pytest.fixture(scope="module")
def scripted_kv_url(serve_instance):
    """The scripted engine with a modelled 1,024-token KV pool (a stand-in for vLLM's block pool), its
    prefill slow (100 tokens/s): ending a retention of ~900 tokens costs ~8 s of re-prefill, so the
    KV budget's cost rule lets a waiting turn wait that long before it ends one."""
    from tests.support.apps import module_app, scripted_app

    args = scripted_app({"kv_capacity_tokens": 1024, "kv_block_size": 32, "tokens_per_second": 500,
                         "prefill_tokens_per_second": 100, "answer_text": "done.", "max_output_tokens": 8},
                        safety={"enabled": False})
    args["engine"]["kv_budget"] = {"ttl_initial_s": 120, "max_queue_wait_s": 120}
    yield from module_app("scriptedkv", "/scriptedkv", args, serve_instance, 240)


async def _turn(ws, text: str, prev=None) -> list[dict]:
    body = {"input": text, "store": False, "max_output_tokens": 8}
    if prev:
        body["previous_response_id"] = prev
    return await turn(ws, body, timeout=120)


async def test_a_turn_waiting_for_kv_is_queued_visibly_and_starts_when_a_closed_socket_releases_its_session(
        scripted_kv_url):
    """B's turn does not fit beside A's retained prefix: it waits (visibly), for less than the ~8 s
    A's re-prefill would cost, and starts at once when A's socket closes with nothing stored."""
    import asyncio

    from websockets.asyncio.client import connect

    url = ws_url(scripted_kv_url)
    run = secrets.token_hex(4)
    async with asyncio.timeout(120):
        a = await connect(url)
        first = await _turn(a, _text(f"{run}-A"))
        assert first[-1]["type"] == "response.completed"
        assert first[-1]["response"]["usage"]["input_tokens"] > 700  # A's retained prefix: over 70% of the pool
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
    assert kv["released"] >= 1 and kv["waited"] >= 1 and kv["preemptions"] == 0 and kv["evicted"] == 0
    assert 50 <= kv["prefill_tokens_per_s"] <= 200  # the engine's rate, measured


async def test_a_waiting_turn_ends_a_retention_once_waiting_would_cost_more_than_its_re_prefill(scripted_kv_url):
    import asyncio

    from websockets.asyncio.client import connect

    url = ws_url(scripted_kv_url)
    run = secrets.token_hex(4)
    async with asyncio.timeout(120), connect(url) as a, connect(url) as b:
        before = _kv(scripted_kv_url)
        a1 = await _turn(a, _text(f"{run}-A"))  # A stays open: retained
        started = time.perf_counter()
        events = await _turn(b, _text(f"{run}-B"))
        waited = time.perf_counter() - started
        assert [e["type"] for e in events][2] == "response.queued" and events[-1]["type"] == "response.completed"
        # B waited about A's re-prefill cost (~860 tokens to free at ~100/s), not the 120 s wait bound
        assert 3 < waited < 60
        after = _kv(scripted_kv_url)
        assert after["evicted"] == before["evicted"] + 1
        again = await _turn(a, "and then?", prev=a1[-1]["response"]["id"])  # A is back: a re-prefill, counted
        assert again[-1]["type"] == "response.completed"
    assert _kv(scripted_kv_url)["reprefills"] == after["reprefills"] + 1


def test_with_pins_off_by_the_version_guard_the_engine_still_serves_and_says_why(serve_instance):
    """vLLM outside the tested range: no retaining scheduler, the turns still run through the KV
    budget, and stats say pins are off and why."""
    from array import array

    import cloudpickle
    from ray import serve

    from actors.engine import EngineReplica
    from cluster.app import engine_options
    from cluster.config import LoopserveConfig
    from cluster.core.messages import EngineDone, EngineRequest
    from tests.support import pins_off_engine

    cloudpickle.register_pickle_by_value(pins_off_engine)  # the replica need not import the tests
    config = LoopserveConfig.model_validate({
        "model": {"max_model_len": 2048},
        "engine": {"backend": "vllm", "vllm": {"block_size": 32, "cpu_kvcache_space_gib": 1,
                                               "num_gpu_blocks_override": BLOCKS}},
        "engine_deployment": {"ray_actor_options": {"num_cpus": 0.5}}})
    app = EngineReplica.options(name="PinsOffEngine", **engine_options(config)).bind(
        config, pins_off_engine.VLLMEngineOnUntestedVersion)
    handle = serve.run(app, name="pinsoff", route_prefix=None)
    try:
        done: list[EngineDone] = []
        for i in range(2):  # a session's two turns, the second continuing the first
            prompt = array("i", [(7 * j + 3) % 500 + 10 for j in range(300 + 40 * i)])
            req = EngineRequest(f"pinsoff-{i}", "pinsoff-session", prompt, Generation(4, sampling={"temperature": 0.0}), expect_back=True)
            for chunk in handle.generate.options(stream=True).remote(req):  # pytest-timeout bounds it
                done += [p for p in chunk if isinstance(p, EngineDone)]
        assert len(done) == 2 and all(d.output_tokens > 0 for d in done)
        kv = handle.stats.remote().result(timeout_s=60)["kv"]
        assert kv["pins_enabled"] == 0 and f"vLLM {pins_off_engine.FUTURE_VLLM} is outside" in kv["pins_off_reason"]
        assert kv["admitted"] == 2 and kv["retained_sessions"] == 1  # the budget still runs
    finally:
        from tests.support.apps import delete_in_background

        delete_in_background("pinsoff")
