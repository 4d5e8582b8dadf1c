"""Auth on every entry point, browser Origin checks, and no secrets or prompts in the logs."""

import asyncio
import json
import secrets
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.support.apps import ALLOWED_ORIGIN, KEY_A
from tests.support.ws import flood_until_closed, ws_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


async def test_websocket_upgrade_needs_a_key_and_an_allowed_origin(pg_url):
    with pytest.raises(InvalidStatus) as no_key:
        await connect(ws_url(pg_url), open_timeout=30)
    assert no_key.value.response.status_code == 401
    assert json.loads(no_key.value.response.body)["error"]["code"] == "missing_api_key"
    auth = {"authorization": f"Bearer {KEY_A}"}
    with pytest.raises(InvalidStatus) as bad_origin:
        await connect(ws_url(pg_url), open_timeout=30, additional_headers={**auth, "origin": "https://evil.example"})
    assert bad_origin.value.response.status_code == 403
    assert json.loads(bad_origin.value.response.body)["error"]["code"] == "origin_not_allowed"
    # A browser on the allowed origin, and a non-browser client (no Origin), both get in.
    for headers in ({**auth, "origin": ALLOWED_ORIGIN}, auth):
        async with connect(ws_url(pg_url), open_timeout=30, additional_headers=headers) as sock:
            await sock.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi"}))
            while (ev := json.loads(await sock.recv()))["type"] not in ("response.completed", "error"):
                pass
            assert ev["type"] == "response.completed"


def test_every_http_route_needs_a_key(pg_url):
    routes = [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
              ("POST", "/v1/responses/resp_x/cancel"), ("GET", "/v1/responses/resp_x/input_items"),
              ("POST", "/v1/responses/input_tokens"), ("POST", "/v1/responses/compact"), ("GET", "/v1/models")]
    for method, path in routes:
        r = httpx.request(method, pg_url + path, json={"input": "x"}, timeout=30,
                          headers={"authorization": "Bearer sk-wrong"})
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"


async def test_no_key_or_prompt_reaches_the_logs(pg_url):
    import ray

    marker = f"confidential-{secrets.token_hex(6)}"
    async with connect(ws_url(pg_url), open_timeout=30, additional_headers={"authorization": f"Bearer {KEY_A}"}) as sock:
        for text in (f"my password is {marker}", "x" * 50 + marker):
            await sock.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": text}))
            while json.loads(await sock.recv())["type"] not in ("response.completed", "response.incomplete", "error"):
                pass
        # a failing request too: errors are logged, their content must not be
        await sock.send(json.dumps({"type": "response.create", "input": [{"type": "bogus", "text": marker}]}))
        await sock.recv()
    httpx.post(pg_url + "/v1/responses", json={"input": marker}, timeout=30,
               headers={"authorization": f"Bearer sk-{marker}"})  # a wrong key that is itself a secret
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    leaked = [p for p in logs.rglob("*") if p.is_file() and marker.encode() in p.read_bytes()]
    assert leaked == []
    assert not [p for p in logs.rglob("*") if p.is_file() and KEY_A.encode() in p.read_bytes()]


# -- operational routes ---------------------------------------------------------------
def _routes() -> set[tuple[str, str]]:
    from actors.routes import router

    out = set()

    def walk(routes):
        for route in routes:
            inner = getattr(getattr(route, "original_router", None), "routes", None)  # FastAPI >= 0.137
            if inner is None and not hasattr(route, "path"):
                inner = getattr(route, "routes", None)
            if inner is not None:
                walk(inner)
                continue
            for m in getattr(route, "methods", None) or {"WEBSOCKET"}:
                if m != "HEAD":
                    out.add((m, route.path))

    walk(router.routes)
    return out


# Who may call what. A route missing here fails `test_every_route_has_a_declared_access_rule`.
TENANT_ROUTES = {("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
                 ("DELETE", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"),
                 ("GET", "/v1/responses/{response_id}/input_items"), ("POST", "/v1/responses/input_tokens"),
                 ("POST", "/v1/responses/compact"), ("GET", "/v1/models"), ("WEBSOCKET", "/v1/responses"),
                 # Conversations: the key's own (another key's are 404: tests/integration/test_conversations.py)
                 ("POST", "/v1/conversations"), ("GET", "/v1/conversations/{conversation_id}"),
                 ("POST", "/v1/conversations/{conversation_id}"), ("DELETE", "/v1/conversations/{conversation_id}"),
                 ("GET", "/v1/conversations/{conversation_id}/items"),
                 ("POST", "/v1/conversations/{conversation_id}/items"),
                 ("GET", "/v1/conversations/{conversation_id}/items/{item_id}"),
                 ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}")}
ADMIN_ROUTES = {("GET", "/loopserve/stats"), ("WEBSOCKET", "/loopserve/echo")}
PUBLIC_ROUTES = {("GET", "/health")}


def test_every_route_has_a_declared_access_rule():
    assert _routes() == TENANT_ROUTES | ADMIN_ROUTES | PUBLIC_ROUTES


def test_stats_need_an_admin_key_not_a_tenant_key(pg_url):
    from tests.support.local_cluster import admin_headers

    for headers, status, code in (({}, 401, "missing_api_key"),
                                  ({"authorization": f"Bearer {KEY_A}"}, 401, "invalid_api_key"),
                                  ({"authorization": "Bearer sk-wrong"}, 401, "invalid_api_key")):
        r = httpx.get(pg_url + "/loopserve/stats", headers=headers, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code)
        assert "turns" not in r.text
    r = httpx.get(pg_url + "/loopserve/stats", headers=admin_headers(), timeout=30)
    assert r.status_code == 200 and "turns" in r.json()


def test_ops_routes_are_closed_without_an_admin_key_configured(short_limit_url):
    from tests.support.local_cluster import admin_headers

    for headers in ({}, admin_headers(), {"authorization": "Bearer anything"}):
        r = httpx.get(short_limit_url + "/loopserve/stats", headers=headers, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"


def test_health_is_open_and_says_nothing_else(pg_url):
    r = httpx.get(pg_url + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_echo_route_is_off_by_default(pg_url):
    from tests.support.local_cluster import admin_headers

    with pytest.raises(InvalidStatus) as off:
        await connect(pg_url.replace("http://", "ws://") + "/loopserve/echo", open_timeout=30,
                      additional_headers=admin_headers())
    assert off.value.response.status_code == 404


async def test_echo_route_when_enabled_needs_an_admin_key_and_keeps_the_limits(scripted_url):
    from tests.support.local_cluster import admin_headers

    url = scripted_url.replace("http://", "ws://") + "/loopserve/echo"
    with pytest.raises(InvalidStatus) as no_key:
        await connect(url, open_timeout=30)
    assert no_key.value.response.status_code == 401
    async with connect(url, open_timeout=30, additional_headers=admin_headers(), max_size=None) as sock:
        await sock.send("ping")
        assert await sock.recv() == "ping"
        await sock.send("x" * (300 * 1024))  # the scripted app's frame limit is 256 KiB
        assert json.loads(await sock.recv())["error"]["code"] == "websocket_message_too_large"
        await sock.send("still here")
        assert await sock.recv() == "still here"


async def test_oversized_frames_are_refused_in_order_and_the_socket_keeps_working(scripted_url):
    """Frames over the limit are answered (after the response in flight), never queued whole."""
    from tests.support.apps import LONG_ONE

    async with connect(ws_url(scripted_url), open_timeout=30, max_size=None) as sock:
        await sock.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": LONG_ONE,
                                    "max_output_tokens": 60, "store": False}))
        for _ in range(16):
            await sock.send("y" * (300 * 1024))
        events = []
        while len([e for e in events if e["type"] == "error"]) < 16:
            events.append(json.loads(await asyncio.wait_for(sock.recv(), 60)))
        kinds = [e["type"] for e in events]
        assert kinds.index("response.incomplete") < kinds.index("error")  # FIFO: after the response
        assert {e["error"]["code"] for e in events if e["type"] == "error"} == {"websocket_message_too_large"}
        await sock.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi",
                                    "store": False}))
        while (ev := json.loads(await asyncio.wait_for(sock.recv(), 60)))["type"] not in ("response.completed",
                                                                                        "error"):
            pass
        assert ev["type"] == "response.completed"


async def test_a_client_flooding_invalid_frames_it_never_reads_is_closed(scripted_url):
    """Flooding frames (Serve's proxy here; HAProxy in tests/cluster/haproxy_scenario.py): each
    frame costs an error event; once the socket's error budget (16 MiB a minute) is spent, or its
    unread errors pile up, the server ends it (its close no longer waits behind a send nobody
    reads), and the server goes on serving others."""
    sent, seconds = await flood_until_closed(ws_url(scripted_url), deadline_s=120)  # raises if still open
    # (`sent` counts what the kernel's buffers took as well: ~870k frames in the 15 s it took here.)
    async with connect(ws_url(scripted_url), open_timeout=30) as sock:
        await sock.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi", "store": False}))
        while (ev := json.loads(await asyncio.wait_for(sock.recv(), 60)))["type"] not in ("response.completed", "error"):
            pass
        assert ev["type"] == "response.completed"
