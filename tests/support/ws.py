"""The tests' WebSocket client: the benchmarks' one turn over a raw socket
(`cluster/bench/client.py`), and one turn over the openai SDK's `responses.connect()`."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional

from cluster.bench.client import ws_turn, ws_url
from cluster.core.events import TERMINAL_EVENTS

__all__ = ["MODEL", "TERMINAL", "flood_until_closed", "sdk_response", "sdk_turn", "turn", "ws_url"]

TERMINAL = tuple(sorted(TERMINAL_EVENTS))
MODEL = "loopserve-tiny"


async def turn(ws, body: dict[str, Any], *, model: Optional[str] = MODEL, timeout: float = 60.0,
               on_event: Optional[Callable[[dict], Awaitable[None]]] = None) -> list[dict]:
    """Send one `response.create` on a raw socket (the `websockets` client); return its events up
    to the terminal one, or up to an error sent before the response was created."""
    seen = await ws_turn(ws, {**({"model": model} if model else {}), **body}, timeout=timeout, on_event=on_event)
    return seen.events


def sdk_turn(conn, **body) -> list:
    """One `response.create` on the openai SDK's WebSocket connection: its events up to the
    terminal one or an error."""
    conn.response.create(**body)
    events = []
    for event in conn:
        events.append(event)
        if event.type in TERMINAL_EVENTS or event.type == "error":
            return events
    raise AssertionError("the socket closed mid-turn")


def sdk_response(conn, **body):
    """The Response of one SDK turn, which must have completed (or stopped incomplete)."""
    last = sdk_turn(conn, **body)[-1]
    assert last.type in ("response.completed", "response.incomplete"), last
    return last.response


async def flood_until_closed(url: str, headers: Optional[dict] = None, deadline_s: float = 120.0) -> tuple[int, float]:
    """Send one-byte invalid frames on a socket that reads nothing (its library stops reading its
    TCP stream after one queued frame) until the server ends it: (frames sent, seconds). The
    client's own keepalive is off: its ping timing out (at ~40 s) would close the socket itself."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    sent, started = 0, asyncio.get_running_loop().time()
    async with connect(url, open_timeout=30, max_queue=1, additional_headers=headers, close_timeout=2,
                       ping_interval=None) as sock:
        try:
            while asyncio.get_running_loop().time() - started < deadline_s:
                await asyncio.wait_for(sock.send("x"), deadline_s)
                sent += 1
                if sent % 256 == 0:
                    await asyncio.sleep(0)
        except ConnectionClosed:
            return sent, asyncio.get_running_loop().time() - started
    raise AssertionError(f"the socket is still open after {sent} invalid frames in {deadline_s:.0f} s")
