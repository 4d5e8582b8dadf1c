"""Auth on every entry point, browser Origin checks, and no secrets or prompts in the logs."""

import json
import secrets
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from .conftest import ALLOWED_ORIGIN, KEY_A

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def ws(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/responses"


async def test_websocket_upgrade_needs_a_key_and_an_allowed_origin(pg_url):
    with pytest.raises(InvalidStatus) as no_key:
        await connect(ws(pg_url), open_timeout=30)
    assert no_key.value.response.status_code == 401
    assert json.loads(no_key.value.response.body)["error"]["code"] == "missing_api_key"
    auth = {"authorization": f"Bearer {KEY_A}"}
    with pytest.raises(InvalidStatus) as bad_origin:
        await connect(ws(pg_url), open_timeout=30, additional_headers={**auth, "origin": "https://evil.example"})
    assert bad_origin.value.response.status_code == 403
    assert json.loads(bad_origin.value.response.body)["error"]["code"] == "origin_not_allowed"
    # A browser on the allowed origin, and a non-browser client (no Origin), both get in.
    for headers in ({**auth, "origin": ALLOWED_ORIGIN}, auth):
        async with connect(ws(pg_url), open_timeout=30, additional_headers=headers) as sock:
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
    async with connect(ws(pg_url), open_timeout=30, additional_headers={"authorization": f"Bearer {KEY_A}"}) as sock:
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
