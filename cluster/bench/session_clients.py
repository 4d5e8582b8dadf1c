"""The many-sessions benchmark's clients: one agent session over each transport.

- `ws`: one WebSocket held for the whole session (`store` as asked), chained by
  `previous_response_id`;
- `ws-stored`: one WebSocket held for the whole session, `store: true`: its close says nothing of
  the session's end (a stored response may be continued from anywhere), as HTTP's end does not;
- `ws-reconnect`: a new WebSocket for every turn (`store: true`, chained by id): a client that
  reconnects, or whose turns land on any connection replica;
- `http`: `POST /v1/responses` per turn (`store: true`, chained by id), as the openai SDKs'
  `responses.create(previous_response_id=...)` does.

Shapes: `plain` adds each turn's text as a user message; `agent` offers a function and answers the
model's last call with the turn's text as its output (a user message when it called none), as a
tool loop does. `ttl` sends `prompt_cache_options.ttl`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from cluster.bench.client import ws_turn, ws_url

TRANSPORTS = ("ws", "ws-stored", "ws-reconnect", "http")
TOOL = {"type": "function", "name": "run_tests", "description": "Run the project's tests",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@dataclass
class SessionPlan:
    """What one session sends: its texts and pauses come from the workload (`sessions.Workload`)."""

    system: str
    url: str
    model: str
    index: int
    n: int
    transport: str = "ws"
    store: bool = False
    shape: str = "plain"  # plain | agent
    ttl: Optional[str] = None  # prompt_cache_options.ttl


def turn_body(plan: SessionPlan, text: str, prev: Optional[dict[str, Any]], output_tokens: int) -> dict[str, Any]:
    """The turn's `response.create` body after the previous response `prev` (None: the first)."""
    body: dict[str, Any] = {"model": plan.model, "max_output_tokens": output_tokens, "temperature": 0,
                            "store": plan.store or plan.transport != "ws"}  # (ws-stored: stored)
    calls = [o for o in (prev or {}).get("output", []) if o.get("type") == "function_call"]
    if plan.shape == "agent":
        body["tools"] = [TOOL]
        body["input"] = ([{"type": "function_call_output", "call_id": c["call_id"], "output": text} for c in calls]
                         if calls else text)
    else:
        body["input"] = text
    if prev is not None:
        body["previous_response_id"] = prev["id"]
    if plan.ttl:
        body["prompt_cache_options"] = {"ttl": plan.ttl}
    return body


async def run_session(plan: SessionPlan, workload: Any, texts: Callable[[int, random.Random], str],
                      record: Callable[[int, dict, float, Optional[float], float], None]) -> None:
    """The session's turns; `record(turn, terminal_event, latency, queued, sent_at)` after each.
    Stops at the first failed turn."""
    import httpx
    from websockets.asyncio.client import connect

    rng = random.Random(workload.seed * 100_003 + plan.index)
    prev: Optional[dict[str, Any]] = None
    held = None
    http = httpx.AsyncClient(timeout=1200) if plan.transport == "http" else None
    try:
        for turn in range(workload.turns + 1):
            if turn:
                await _sleep(workload.pause_s(rng))
            body = turn_body(plan, texts(turn, rng), prev, workload.output_tokens)
            t0 = time.perf_counter()
            if http is not None:
                r = await http.post(plan.url + "/v1/responses", json=body)
                ev = {"type": "response.completed", "response": r.json()} if r.status_code == 200 else \
                    {"type": "error", "error": r.text[:300]}
                latency, queued = time.perf_counter() - t0, None  # a plain POST shows no wait
            else:
                if held is None or plan.transport == "ws-reconnect":
                    if held is not None:
                        await held.close()
                    held = await connect(ws_url(plan.url), max_size=None, compression=None, open_timeout=120,
                                         ping_timeout=None)
                    t0 = time.perf_counter()  # the handshake is the client's own choice, not the turn
                seen = await ws_turn(held, body, keep_events=False)
                ev, latency, queued = seen.last, seen.wall_s, seen.queued_s
            record(turn, ev, latency, queued, t0)
            if ev.get("type") == "error" or ev["response"]["status"] == "failed":
                return
            prev = ev["response"]
    finally:
        if held is not None:
            await held.close()
        if http is not None:
            await http.aclose()


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
