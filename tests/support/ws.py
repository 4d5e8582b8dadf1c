"""One WebSocket client for the tests: the URL, one turn over a raw socket, one turn over the
openai SDK's `responses.connect()`."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Optional

from cluster.core.events import TERMINAL_EVENTS

TERMINAL = tuple(sorted(TERMINAL_EVENTS))
MODEL = "loopserve-tiny"


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/v1/responses"


async def turn(ws, body: dict[str, Any], *, model: Optional[str] = MODEL, timeout: float = 60.0,
               on_event: Optional[Callable[[dict], Awaitable[None]]] = None) -> list[dict]:
    """Send one `response.create` on a raw socket (the `websockets` client); return its events up
    to the terminal one, or up to an error sent before the response was created."""
    await ws.send(json.dumps({"type": "response.create", **({"model": model} if model else {}), **body}))
    events: list[dict] = []
    created = False
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        events.append(ev)
        created = created or ev["type"] == "response.created"
        if on_event is not None:
            await on_event(ev)
        if ev["type"] in TERMINAL_EVENTS or (ev["type"] == "error" and not created):
            return events


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
