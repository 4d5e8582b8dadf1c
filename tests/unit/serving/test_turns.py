"""Where a turn enters (cluster/serving/turns.py), without Ray or sockets: the HTTP create folds a
turn into one response or hands back its stream, refusals are `ApiError`s in the API's shape, and
a WebSocket is admitted, wired and torn down with what it held."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster import telemetry
from cluster.auth import Authenticator, key_sha256
from cluster.config import AuthConfig, LoopserveConfig
from cluster.core.turn.cache import CacheMemory, SessionCache
from cluster.protocol.errors import ApiError
from cluster.serving.responses import ResponsesService
from cluster.serving.turns import StreamedTurn, TurnsService
from tests.support.harness import InProcessStack

KEY = "sk-test-turns"


class RecordingEngineClient:
    """Fake of `EngineClient.release` (the real one needs a Serve handle to an engine replica):
    records which sessions' engine KV a closed socket gave back."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def release(self, session_key: str, cache_salt) -> None:
        self.released.append(session_key)


def _service(tokenizer, **config) -> tuple[TurnsService, RecordingEngineClient, InProcessStack]:
    stack = InProcessStack(tokenizer)
    cfg = LoopserveConfig(**config)
    engine = RecordingEngineClient()
    responses = ResponsesService(stack.driver, SessionCache(), None)

    async def settle(ids):
        return True

    auth = Authenticator(cfg.auth.resolved())
    return TurnsService(cfg, driver=stack.driver, responses=responses, auth=auth, memory=CacheMemory(64, 1 << 24, 1 << 26),
                        engine=engine, metrics=telemetry.Metrics(), settle=settle), engine, stack


def _body(**extra) -> dict:
    return {"model": "loopserve-tiny", "input": "hello", **extra}


async def test_an_http_create_is_one_response_or_its_stream(tokenizer):
    turns, _, _ = _service(tokenizer)
    p = turns.auth.authenticate(None)
    final = await turns.create(_body(), p, {}, 0.0)
    assert final["object"] == "response" and final["status"] == "completed"
    assert final["output"][0]["type"] == "message"

    streamed = await turns.create(_body(stream=True), p, {}, 0.0)
    assert isinstance(streamed, StreamedTurn)
    assert streamed.first["type"] == "response.created"
    rest = [ev async for ev in streamed.rest]
    assert rest[-1]["type"] == "response.completed"
    assert rest[-1]["response"]["id"] == streamed.first["response"]["id"]


async def test_a_refused_or_failed_http_turn_raises_its_api_error(tokenizer):
    turns, _, stack = _service(tokenizer)
    p = turns.auth.authenticate(None)
    with pytest.raises(ApiError) as refused:
        await turns.create({"model": "loopserve-tiny", "input": 7}, p, {}, 0.0)
    assert refused.value.status == 400 and refused.value.param == "input"
    with pytest.raises(ApiError) as missing:
        await turns.create(_body(previous_response_id="resp_nope"), p, {}, 0.0)
    assert missing.value.status == 400 and missing.value.code == "previous_response_not_found"
    stack.fail_engine = True  # the engine replica dies
    with pytest.raises(ApiError) as failed:
        await turns.create(_body(), p, {}, 0.0)
    assert failed.value.status >= 500


async def test_a_background_create_is_queued_and_finishes(tokenizer):
    turns, _, _ = _service(tokenizer)
    p = turns.auth.authenticate(None)
    queued = await turns.create(_body(background=True, store=True), p, {}, 0.0)
    assert queued["status"] == "queued"
    for _ in range(200):
        if not turns.responses.background:
            break
        await asyncio.sleep(0.02)
    assert (await turns.responses.retrieve(queued["id"], p.tenant))["status"] == "completed"


def test_a_socket_is_refused_before_the_upgrade(tokenizer):
    keys = AuthConfig(keys=[{"sha256": key_sha256(KEY), "tenant": "t", "max_connections": 1}])
    turns, _, _ = _service(tokenizer, auth=keys, websocket={"allowed_origins": ["https://ok.example"]})
    with pytest.raises(ApiError) as no_key:
        turns.admit_socket({})
    assert no_key.value.status == 401
    with pytest.raises(ApiError) as long_name:
        turns.admit_socket({"authorization": f"Bearer {KEY}", "x-session-id": "s" * 10_000})
    assert long_name.value.status == 400 and long_name.value.param == "x-session-id"
    with pytest.raises(ApiError) as origin:
        turns.admit_socket({"authorization": f"Bearer {KEY}", "origin": "https://evil.example"})
    assert origin.value.status == 403 and origin.value.code == "origin_not_allowed"
    p = turns.admit_socket({"authorization": f"Bearer {KEY}", "origin": "https://ok.example"})
    assert p.tenant == "t"
    with pytest.raises(ApiError) as over:  # the key's one connection is taken
        turns.admit_socket({"authorization": f"Bearer {KEY}"})
    assert over.value.status == 429
    turns.abandon_socket(p)  # that client left during the upgrade: the connection is free again
    turns.abandon_socket(turns.admit_socket({"authorization": f"Bearer {KEY}"}))
    turns.draining = True
    with pytest.raises(ApiError) as draining:
        turns.admit_socket({"authorization": f"Bearer {KEY}"})
    assert draining.value.status == 503 and draining.value.code == "server_draining"


def test_a_server_without_keys_admits_only_pages_served_from_this_machine(tokenizer):
    turns, _, _ = _service(tokenizer)  # no API keys, no allowed_origins
    for origin in ("http://localhost:3000", "http://127.0.0.1:8000", "http://[::1]:5173", "http://app.localhost"):
        assert turns.admit_socket({"origin": origin}).tenant == "default"
    for origin in ("https://evil.example", "http://127.0.0.1.evil.example", "null"):
        with pytest.raises(ApiError) as refused:
            turns.admit_socket({"origin": origin})
        assert refused.value.status == 403 and "websocket.allowed_origins" in refused.value.message
    assert turns.admit_socket({}).tenant == "default"  # SDKs and CLIs send no Origin
    keyed, _, _ = _service(tokenizer, auth=AuthConfig(keys=[{"sha256": key_sha256(KEY), "tenant": "t"}]))
    assert keyed.admit_socket({"authorization": f"Bearer {KEY}", "origin": "https://app.example"}).tenant == "t"


async def _one_turn(turns: TurnsService, store: bool, headers: dict) -> tuple[list[dict], object]:
    sent: list[dict] = []

    async def send(ev):
        sent.append(ev)

    async def close(code, reason):
        pass

    p = turns.admit_socket(headers)
    socket = await turns.open_socket(p, headers, send, close)
    assert socket in turns.sockets
    await socket.session.on_frame(json.dumps({"type": "response.create", **_body(store=store)}))
    for _ in range(500):
        if any(e["type"] == "response.completed" for e in sent):
            break
        await asyncio.sleep(0.01)
    await socket.session.wait_idle()
    await turns.close_socket(socket)
    return sent, socket


async def test_a_closed_socket_gives_back_its_connection_and_unstored_kv(tokenizer):
    keys = AuthConfig(keys=[{"sha256": key_sha256(KEY), "tenant": "t", "max_connections": 1}])
    turns, engine, _ = _service(tokenizer, auth=keys)
    headers = {"authorization": f"Bearer {KEY}", "x-session-id": "agent-1"}
    sent, socket = await _one_turn(turns, False, headers)
    assert sent[-1]["type"] == "response.completed"
    assert not turns.sockets and socket.session.closed
    assert engine.released == [socket.session.session_key]  # store: false only: nothing to continue from
    sent, socket = await _one_turn(turns, True, headers)  # the key's one connection was given back
    assert sent[-1]["type"] == "response.completed"
    assert len(engine.released) == 1  # a stored response may be continued: KV kept
    assert turns.responses.registry.get(sent[-1]["response"]["id"]) is not None
    # A socket naming the same session that runs nothing does not free its KV
    socket = await turns.open_socket(turns.admit_socket(headers), headers, lambda ev: asyncio.sleep(0),
                                     lambda code, reason: asyncio.sleep(0))
    await turns.close_socket(socket)
    assert len(engine.released) == 1


async def test_a_socket_opened_while_draining_is_drained(tokenizer):
    turns, _, _ = _service(tokenizer)
    closed: list[int] = []

    async def send(ev):
        pass

    async def close(code, reason):
        closed.append(code)

    p = turns.admit_socket({})
    turns.draining = True  # the replica began draining between the upgrade and the session's start
    socket = await turns.open_socket(p, {}, send, close)
    for _ in range(200):
        if closed:
            break
        await asyncio.sleep(0.01)
    assert closed, "the session was not closed for the drain"
    await turns.close_socket(socket)


async def test_one_tenant_cannot_take_every_background_slot(tokenizer):
    """Background slots are per replica; one key may hold at most its share."""
    stack = InProcessStack(tokenizer, tokens_per_second=5)  # slow: the responses stay in progress
    responses = ResponsesService(stack.driver, SessionCache(), None, max_background=3, max_background_per_tenant=2)
    from cluster.protocol.requests import parse_request

    req = parse_request({**_body(background=True, store=True), "max_output_tokens": 200})
    try:
        for _ in range(2):
            responses.start_background(req, "tenant-a", "s")
        with pytest.raises(ApiError) as over:
            responses.start_background(req, "tenant-a", "s")
        assert over.value.status == 429 and "of yours" in over.value.message
        assert responses.start_background(req, "tenant-b", "s")["status"] == "queued"  # another key still gets one
        with pytest.raises(ApiError) as full:
            responses.start_background(req, "tenant-c", "s")
        assert full.value.status == 429 and "limit 3" in full.value.message
    finally:
        for job in list(responses.background.values()):
            job.task.cancel()
