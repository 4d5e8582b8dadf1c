"""Connection lifetime over real sockets: server pings and the connection limit."""

import asyncio
import base64
import json
import os
import socket
import struct
import time

import pytest
from websockets.asyncio.client import connect

from tests.support.ws import ws_url

pytestmark = pytest.mark.integration


async def test_connection_limit_sends_error_then_close_1000(short_limit_url):
    url = ws_url(short_limit_url)
    async with connect(url, open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "input": "hi"}))
        events = []
        t0 = time.monotonic()
        try:
            while True:
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
        except Exception:
            pass
        assert time.monotonic() - t0 < 9
        assert events[-1]["type"] == "error"
        assert events[-1]["error"]["code"] == "websocket_connection_limit_reached"
        assert "response.completed" in [e["type"] for e in events]
        assert ws.close_code == 1000


@pytest.fixture
def raw_ws(scripted_url):
    host, port = scripted_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (f"GET /v1/responses HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
         f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101")
    yield sock
    sock.close()


def test_server_pings_idle_connections(raw_ws):
    deadline = time.monotonic() + 28
    while time.monotonic() < deadline:
        b0, b1 = raw_ws.recv(1)[0], raw_ws.recv(1)[0]
        length = b1 & 0x7F
        if length == 126:
            length = struct.unpack(">H", raw_ws.recv(2))[0]
        elif length == 127:
            length = struct.unpack(">Q", raw_ws.recv(8))[0]
        raw_ws.recv(length) if length else b""  # payload unused
        if b0 & 0x0F == 0x9:
            return  # a ping from the server
    pytest.fail("no ping from the server within 28 s")
