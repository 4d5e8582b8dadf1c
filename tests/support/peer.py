"""A client on a `WebSocketSession` in process (no socket): what it was sent, and waiting for it."""

from __future__ import annotations

import asyncio
import json

from cluster.config import WebSocketConfig
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.turn import TurnScope
from cluster.core.websocket.session import ReplicaShared, WebSocketSession

TOOLS = [{"type": "function", "name": "read_file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


class Peer:
    """A client on a WebSocketSession. `sent` holds what it received except `response.queued`
    announcements (kept in `queued`: they precede their response, whatever else interleaves)."""

    def __init__(self, stack, betas=frozenset(), settle=None, heavy=None, on_state=None, **cfg):
        self.sent = []
        self.queued = []
        self.all = []
        self.closed = None
        self.stack = stack
        self.session = WebSocketSession(
            stack.driver, TurnScope(SessionCache(), session_key="conn", transport="websocket", on_state=on_state),
            config=WebSocketConfig(**cfg), send=self.send, close=self.close, betas=frozenset(betas),
            shared=ReplicaShared(settle=settle, heavy=heavy),
        )
        self.session.start()

    async def send(self, ev):
        self.all.append(ev)
        (self.queued if ev["type"] == "response.queued" else self.sent).append(ev)

    async def close(self, code, reason):
        self.closed = code

    async def frame(self, obj):
        await self.session.on_frame(obj if isinstance(obj, (str, bytes)) else json.dumps(obj))

    async def idle(self):
        await asyncio.wait_for(self.session.wait_idle(), 10)

    def types(self):
        return [e["type"] for e in self.sent]

    def terminals(self):
        return [e["response"] for e in self.sent if e["type"] in ("response.completed", "response.incomplete")]


async def wait_for(p, kind, n=1):
    for _ in range(500):
        if sum(e["type"] == kind for e in p.sent) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {kind} in {p.types()}")


def of_type(p, kind):
    return [e for e in p.sent if e["type"] == kind]
