"""Faults: replicas killed mid-stream, a client that vanishes, the store going away.

Every `response.create` must end in exactly one terminal event (or an error
before `response.created`), sockets stay usable, and the next turn succeeds.
"""

import asyncio
import json
import time

import httpx
import pytest
import ray
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.support.local_cluster import stats as server_stats
from tests.support.apps import delete_in_background, deploy_app, ensure_pg_database, module_app, scripted_app
from tests.support.ws import TERMINAL, turn, ws_url

from .tcp_proxy import TcpProxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def faults_url(serve_instance, tmp_path_factory):
    """Slow scripted engine (turns of ~2 s, so kills land mid-stream), 2 engine replicas. Serve
    checks each replica's health every 2 s (its default is 10 s): a killed replica is found and
    replaced in about the time a restart takes, which the retries and reconnects below wait for."""
    health = {"health_check_period_s": 2}
    args = scripted_app({"tokens_per_second": 30, "answer_text": "word " * 40, "max_output_tokens": 256},
                        store={"backend": "sqlite", "sqlite_path": str(tmp_path_factory.mktemp("faults") / "r.db")},
                        engine_deployment={"num_replicas": 2, **health}, connection=health, render=health,
                        # a SafetyActor to kill
                        safety={"placement": "actor", "deployment": {"ray_actor_options": {"num_cpus": 0.05}, **health}})
    yield from module_app("faults", "/faults", args, serve_instance, 240)


def kill(deployment: str, unique_id: str = "", app: str = "faults") -> None:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if f"{app}#{deployment}#" in name and unique_id in name:
            ray.kill(ray.get_actor(name, namespace=actor["namespace"]), no_restart=False)
            return
    raise AssertionError(f"no {deployment} replica {unique_id!r} in {app}")


def stats(url: str, engine_session: str = "") -> dict:
    return server_stats(url, last=50, **({"engine_session": engine_session} if engine_session else {}))


def once_on_first_delta(action):
    """An `on_event` that runs `action` at the first text delta (mid-stream), once."""
    done = False

    async def on_event(ev: dict) -> None:
        nonlocal done
        if not done and ev["type"] == "response.output_text.delta":
            done = True
            await action()

    return on_event


async def test_engine_replica_killed_mid_stream(faults_url):
    async with connect(ws_url(faults_url), open_timeout=30, additional_headers={"x-session-id": "fault-engine"}) as ws:
        first = (await turn(ws, {"input": "hello"}))[-1]["response"]
        replica = stats(faults_url)["turns"][-1]["engine_replica"]
        events = await turn(ws, {"input": "more", "previous_response_id": first["id"]},
                            on_event=once_on_first_delta(lambda: asyncio.to_thread(kill, "EngineReplica", replica)))
        types = [e["type"] for e in events]
        assert types[0] == "response.created" and types[-2:] == ["error", "response.failed"]
        assert sum(t in TERMINAL for t in types) == 1
        failed = events[-1]["response"]
        assert failed["error"]["code"] == "server_error"  # retryable
        # The socket still works; the retried turn runs on the surviving replica.
        again = await turn(ws, {"input": "more", "previous_response_id": first["id"]})
        assert again[-1]["type"] == "response.completed", again[-1]
        assert stats(faults_url)["turns"][-1]["engine_replica"] != replica


@pytest.mark.parametrize("deployment", ["RenderActor", "SafetyActor"])
async def test_render_or_safety_replica_killed(faults_url, deployment):
    async with connect(ws_url(faults_url), open_timeout=30) as ws:
        await turn(ws, {"input": "warm"})
        await asyncio.to_thread(kill, deployment)
        # A new conversation needs a full render and an input classification right away.
        events = await turn(ws, {"input": "a brand new conversation"})
        # The call to the dead replica is retried (routing.engine_retries) until Serve's
        # replacement answers: the turn completes.
        assert events[-1]["type"] == "response.completed", events[-1]
        again = await turn(ws, {"input": "and again"})
        assert again[-1]["type"] == "response.completed", again[-1]


async def test_connection_actor_killed_client_reconnects_and_continues_from_store(faults_url):
    async with connect(ws_url(faults_url), open_timeout=30) as ws:
        first = (await turn(ws, {"input": "remember me", "store": True}))[-1]["response"]
        await asyncio.to_thread(kill, "ConnectionActor")
        with pytest.raises(ConnectionClosed):
            for _ in range(10):
                await turn(ws, {"input": "are you there?", "previous_response_id": first["id"]})
    deadline = time.time() + 90
    while True:  # Serve restarts the replica; the client reconnects like Codex does
        try:
            async with connect(ws_url(faults_url), open_timeout=30) as ws:
                events = await turn(ws, {"input": "continue", "previous_response_id": first["id"]})
                break
        except (OSError, ConnectionClosed, Exception):
            if time.time() > deadline:
                raise
            await asyncio.sleep(1)
    assert events[-1]["type"] == "response.completed", events[-1]
    assert events[-1]["response"]["previous_response_id"] == first["id"]


async def test_client_vanishing_mid_stream_aborts_and_frees(faults_url):
    # One session key: the sticky router sends all three to one engine replica, whose
    # counters `engine_session` asks for.
    session = "vanishing-clients"
    before = stats(faults_url, session)
    for _ in range(3):
        ws = await connect(ws_url(faults_url), open_timeout=30, additional_headers={"x-session-id": session})
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "long answer"}))
        while json.loads(await ws.recv())["type"] != "response.output_text.delta":
            pass
        ws.transport.abort()  # no close frame: the TCP connection just dies
    await asyncio.sleep(3)
    after = stats(faults_url, session)
    assert after["open_sockets"] == before["open_sockets"]
    assert after["engine"]["replica"] == before["engine"]["replica"]
    assert after["engine"]["aborted"] - before["engine"]["aborted"] == 3
    assert after["engine"]["in_flight"] == 0
    assert after["turn_status"].get("cancelled", 0) - before["turn_status"].get("cancelled", 0) == 3
    assert after["tasks"] <= before["tasks"] + 2, (before["tasks"], after["tasks"])


async def test_store_unavailable_requests_fail_cleanly_and_writes_resume(serve_instance):
    import asyncpg

    dsn = ensure_pg_database()
    with TcpProxy("127.0.0.1", 5432) as proxy:
        args = {
            "engine": {"backend": "scripted"},
            "store": {"backend": "postgres", "postgres_dsn": f"postgresql://postgres@127.0.0.1:{proxy.port}/loopserve_test",
                      "write_retry_s": 60},
            "safety": {"enabled": False},
            "connection": {"ray_actor_options": {"num_cpus": 0.05}}, "render": {"ray_actor_options": {"num_cpus": 0.05}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.05}},
        }
        url = await asyncio.to_thread(deploy_app, "pgcut", "/pgcut", args, serve_instance, 240)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                r = await client.post(url + "/v1/responses", json={"model": "loopserve-tiny", "input": "before"})
                assert r.status_code == 200
                proxy.cut()  # PostgreSQL unreachable
                r = await client.post(url + "/v1/responses", json={"model": "loopserve-tiny", "input": "during"})
                assert r.status_code == 200  # the turn itself does not need the store
                during = r.json()["id"]
                # A read that must go to the store: a clean, retryable 503 in the API's shape.
                miss = await client.get(url + "/v1/responses/resp_not_in_memory")
                assert miss.status_code == 503
                assert miss.json()["error"]["code"] == "store_unavailable"
                ws_err = None
                async with connect(ws_url(url), open_timeout=30) as ws:
                    ws_err = (await turn(ws, {"input": "x", "previous_response_id": "resp_not_in_memory"}))[-1]
                    assert ws_err["type"] == "error" and ws_err["error"]["code"] == "store_unavailable"
                    ok = await turn(ws, {"input": "the socket still works"})
                    assert ok[-1]["type"] == "response.completed"
                await asyncio.sleep(2)
                proxy.restore()
                conn = await asyncpg.connect(dsn)
                try:
                    for _ in range(60):  # the pending write lands once the store is back
                        if await conn.fetchval("SELECT count(*) FROM responses WHERE id = $1", during):
                            break
                        await asyncio.sleep(0.5)
                    else:
                        raise AssertionError("the write made during the outage never reached the store")
                finally:
                    await conn.close()
                s = (await asyncio.to_thread(server_stats, url))["store_writes"]
                assert s["retried"] >= 1 and s["failed"] == 0
        finally:
            delete_in_background("pgcut")
