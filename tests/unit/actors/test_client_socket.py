"""A client that reads nothing is cut, not waited on for ever: a real uvicorn server (the one Ray
Serve's replicas run, with its default WebSocket protocol) and real sockets, no Ray."""

import asyncio
import base64
import os
import socket
import struct
import time

import pytest
import uvicorn
from fastapi import FastAPI, WebSocket
from websockets.asyncio.client import connect

from actors import client_socket

pytestmark = pytest.mark.timeout(60)
FRAME = "y" * 65536


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(app: FastAPI):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    return server, task, f"ws://127.0.0.1:{port}/ws"


async def flood_reading_nothing(port: int, deadline_s: float) -> float:
    """A raw client: the upgrade, then masked one-byte frames and never a read. Seconds until a
    send fails (the connection was reset)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    assert b" 101 " in await reader.readuntil(b"\r\n\r\n")
    frame = b"\x81\x81" + struct.pack("!I", 0) + b"x"  # text "x", zero mask
    started = time.monotonic()
    try:
        while time.monotonic() - started < deadline_s:
            writer.write(frame * 256)
            await asyncio.wait_for(writer.drain(), deadline_s)
    except (ConnectionError, asyncio.TimeoutError) as exc:
        if isinstance(exc, asyncio.TimeoutError):
            raise AssertionError(f"no reset in {deadline_s} s") from None
        return time.monotonic() - started
    finally:
        writer.transport.abort()
    raise AssertionError(f"no reset in {deadline_s} s")


def sending_app(outcome: asyncio.Future, frames: int = 10_000, stall_s: float = 1.0) -> FastAPI:
    """Sends `frames` of 64 KiB; `outcome` gets ("sent", n) or ("cut", n, seconds since the last
    send that went through)."""
    app = FastAPI()

    @app.websocket("/ws")
    async def ws_route(ws: WebSocket) -> None:
        await ws.accept()
        n, last = 0, time.monotonic()
        try:
            for n in range(frames):
                await client_socket.send_text(ws, FRAME, stall_s)
                last = time.monotonic()
            await client_socket.close(ws, 1000, "done", stall_s)
            outcome.set_result(("sent", frames))
        except client_socket.ClientStalled:
            outcome.set_result(("cut", n, time.monotonic() - last))

    return app


async def test_a_client_reading_nothing_is_cut_after_the_stall_and_sees_its_connection_reset():
    outcome = asyncio.get_running_loop().create_future()
    server, task, url = await serve(sending_app(outcome))
    try:
        # The client floods frames the app never reads and reads none of the app's 64 KiB frames.
        seconds = await flood_reading_nothing(int(url.split(":")[2].split("/")[0]), deadline_s=30)
        kind, n, stalled = await asyncio.wait_for(outcome, 10)
        assert kind == "cut" and 0 < n < 10_000  # the buffers took some, then nothing moved
        assert 0.9 <= stalled < 5  # cut after the 1 s stall, not at a proxy's or kernel's timeout
        assert seconds < 15  # the reset reached the client: its blocked sends fail
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_a_client_that_reads_gets_every_frame_and_the_close():
    outcome = asyncio.get_running_loop().create_future()
    server, task, url = await serve(sending_app(outcome, frames=200, stall_s=1.0))
    try:
        got = 0
        async with connect(url, max_size=None) as ws:
            async for frame in ws:
                assert frame == FRAME
                got += 1
                if got % 50 == 0:
                    await asyncio.sleep(0.3)  # a slow reader is not a stalled one
            assert ws.close_code == 1000
        assert got == 200 and await asyncio.wait_for(outcome, 10) == ("sent", 200)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def test_a_socket_without_a_transport_is_not_aborted():
    """Serve's own proxy relays frames: the receive callable is not uvicorn's, nothing to abort."""
    async def receive():  # pragma: no cover - never called
        return {}

    ws = WebSocket({"type": "websocket", "path": "/", "headers": []}, receive, receive)
    assert client_socket.abort(ws) is False


async def test_a_sender_cancelled_as_its_send_completes_stays_cancelled():
    """A lane cancelled because its client left must stop, even when its send completes in the
    same pass of the loop (Python 3.11's `wait_for` returned the send's result then, and the lane
    ran on to the end of its answer)."""
    gate = asyncio.get_running_loop().create_future()

    class Socket:
        async def send_text(self, text: str) -> None:
            await gate

    async def lane() -> str:
        await client_socket.send_text(Socket(), "x", 10.0)
        return "went on"

    task = asyncio.create_task(lane())
    for _ in range(3):
        await asyncio.sleep(0)  # it waits on its send
    gate.set_result(None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
