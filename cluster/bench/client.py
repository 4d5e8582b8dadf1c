"""One Responses API client turn, as the benchmarks and the tests drive it: send a
`response.create` on a WebSocket (or POST with `stream: true`) and read its events up to
the terminal one, on the client's clock.

A turn ends at its terminal event (`response.completed` / `incomplete` / `failed`), or at an
`error` sent before the response was created (the request was refused; an error after
`response.created` is about something else, e.g. a steer, and the turn goes on).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from cluster.core.events import TERMINAL_EVENTS

TOKEN_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")


def ws_url(http_url: str) -> str:
    """The WebSocket mode URL of a server's base HTTP URL."""
    return http_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/v1/responses"


@dataclass
class ClientTurn:
    """What the client saw of one turn. Times are seconds after the request was sent."""

    events: list[dict[str, Any]] = field(default_factory=list)
    sent_bytes: int = 0
    wall_s: float = 0.0  # to the last event
    first_event_s: float = 0.0
    first_token_s: float = 0.0  # first text or tool-argument delta
    created_s: float = 0.0  # `response.created`
    queued_s: float = 0.0  # between `response.queued` and the next event (loopserve's KV budget)

    @property
    def last(self) -> dict[str, Any]:
        return self.events[-1]

    @property
    def ok(self) -> bool:
        return bool(self.events) and self.last["type"] in TERMINAL_EVENTS

    @property
    def response(self) -> dict[str, Any]:
        """The final Response object; a refused turn raises with the server's error event."""
        if not self.ok:
            raise RuntimeError(f"the turn did not finish: {self.events[-1] if self.events else 'no events'}")
        return self.last["response"]


class _Reader:
    """Folds one turn's events into a ClientTurn and says when the turn is over."""

    def __init__(self, turn: ClientTurn, t0: float, keep: bool) -> None:
        self.turn, self.t0, self.keep = turn, t0, keep
        self.created = False
        self.queued_at: Optional[float] = None

    def add(self, ev: dict[str, Any]) -> bool:
        now = time.perf_counter() - self.t0
        turn, kind = self.turn, ev.get("type")
        if self.keep or kind in TERMINAL_EVENTS or kind == "error":
            turn.events.append(ev)
        turn.wall_s = now
        turn.first_event_s = turn.first_event_s or now
        if not turn.first_token_s and kind in TOKEN_DELTAS:
            turn.first_token_s = now
        if self.queued_at is not None:
            turn.queued_s += now - self.queued_at
            self.queued_at = None
        if kind == "response.queued":
            self.queued_at = now
        elif kind == "response.created":
            self.created = True
            turn.created_s = now
        return kind in TERMINAL_EVENTS or (kind == "error" and not self.created)


async def ws_turn(ws, body: dict[str, Any], *, timeout: Optional[float] = None, keep_events: bool = True,
                  on_event: Optional[Callable[[dict], Awaitable[None]]] = None) -> ClientTurn:
    """One `response.create` on a `websockets` client socket. `timeout` bounds the wait for each
    event; `keep_events=False` keeps only the terminal event (long benchmark runs)."""
    payload = json.dumps({"type": "response.create", **body})
    turn = ClientTurn(sent_bytes=len(payload.encode()))
    reader = _Reader(turn, time.perf_counter(), keep_events)
    await ws.send(payload)
    while True:
        raw = await (asyncio.wait_for(ws.recv(), timeout) if timeout else ws.recv())
        ev = json.loads(raw)
        if on_event is not None:
            await on_event(ev)
        if reader.add(ev):
            return turn


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a Server-Sent Events stream (httpx's `aiter_lines()`)."""
    async for line in lines:
        if line.startswith("data: {"):
            yield json.loads(line[6:])


async def http_turn(client, url: str, body: dict[str, Any], *, headers: Optional[dict[str, str]] = None,
                    keep_events: bool = True) -> ClientTurn:
    """One streamed `POST {url}/v1/responses` on an `httpx.AsyncClient`."""
    payload = json.dumps({**body, "stream": True}).encode()
    turn = ClientTurn(sent_bytes=len(payload))
    reader = _Reader(turn, time.perf_counter(), keep_events)
    async with client.stream("POST", url + "/v1/responses", content=payload,
                             headers={**(headers or {}), "content-type": "application/json"}) as r:
        if r.status_code >= 400:
            body_text = (await r.aread()).decode(errors="replace")
            turn.events.append({"type": "error", "status": r.status_code, "error": body_text})
            return turn
        async for ev in sse_events(r.aiter_lines()):
            if reader.add(ev):
                break
    return turn
