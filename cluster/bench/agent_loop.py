"""A Codex-like agent loop against a running loopserve, in three client modes.

Each turn the model calls a tool; the client "runs" it (optional delay) and
sends a `function_call_output` of `tool_output_bytes` plus a short user
message, so the history grows every turn. Modes:

- `http-stateless`: the full history in every request (SSE), no previous id;
- `http-chained`:   `previous_response_id` over HTTP (SSE), `x-session-id` set;
- `websocket`:      one socket, `previous_response_id`, only new items.

Every run starts with a random prefix so no run hits the KV cache of another.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from cluster.bench.client import ClientTurn, http_turn, ws_turn, ws_url

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file from the repository",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
INSTRUCTIONS = "You are a coding agent. Read files with read_file and fix the failing test."
MODES = ("http-stateless", "http-chained", "websocket")


@dataclass
class Turn:
    turn: int
    response_id: str
    wall_s: float
    first_event_s: float
    first_token_s: float
    bytes_sent: int
    input_tokens: int
    cached_tokens: int
    server: dict[str, Any] = field(default_factory=dict)  # the server's own timing of this turn

    @property
    def overhead_s(self) -> Optional[float]:
        """What the client waited beyond the engine's own work (the replica's clock):
        proxy, framing, connection logic, render, safety wait, the engine hop and stream."""
        s = self.server
        return (self.wall_s - s["engine_inner"]) if s else None

    def split(self) -> dict[str, float]:
        """Where `overhead_s` went (seconds): outside the connection replica (client framing,
        proxy), inside it before/around the engine call, and the engine handle hop + stream."""
        s = self.server
        if not s:
            return {}
        return {"outside_server": self.wall_s - s["total"], "connection": s["total"] - s["engine"],
                "render": s.get("render", 0.0), "safety_input": s.get("safety_input_ms", 0.0) / 1000,
                "engine_hop": s["engine"] - s["engine_inner"], "engine_dispatch": s.get("engine_dispatch", 0.0)}


def _file(turn: int, size: int, prefix: str) -> str:
    line = f"{prefix} line of src/module_{turn}.py: def handler(request): return process(request)\n"
    return (line * (size // len(line) + 1))[:size]


class Loop:
    """One agent loop in one mode; `run()` returns its turns."""

    def __init__(self, base_url: str, mode: str, turns: int, tool_output_bytes: int, tool_delay_s: float = 0.0,
                 model: str = "loopserve-tiny", api_key: str = "sk-bench", progress=None, store: bool = True) -> None:
        assert mode in MODES, mode
        self.base = base_url.rstrip("/")
        self.mode, self.turns, self.size, self.delay = mode, turns, tool_output_bytes, tool_delay_s
        self.model, self.api_key = model, api_key
        self.prefix = secrets.token_hex(8)  # unique per run
        self.session = f"bench-{self.prefix}"
        self.progress = progress
        self.store = store  # the same in every mode (http-chained needs it)

    def _body(self, items: list[dict[str, Any]], prev: Optional[str]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "tools": TOOLS, "instructions": INSTRUCTIONS,
                                "input": items, "store": self.store, "max_output_tokens": 64,
                                # like Codex: a stable cache key per conversation
                                "prompt_cache_key": self.session}
        if prev:
            body["previous_response_id"] = prev
        return body

    async def run(self) -> list[Turn]:
        first = [{"type": "message", "role": "user",
                  "content": f"[{self.prefix}] The test in tests/test_app.py fails. Find and fix the bug."}]
        if self.mode == "websocket":
            return await self._run_ws(first)
        return await self._run_http(first)

    def _next_items(self, turn: int, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls = [o for o in output if o["type"] == "function_call"]
        items = [{"type": "function_call_output", "call_id": c["call_id"], "output": _file(turn, self.size, self.prefix)}
                 for c in calls]
        items.append({"type": "message", "role": "user", "content": f"Turn {turn}: keep going, read the next file."})
        return items

    async def _run_http(self, new_items: list[dict[str, Any]]) -> list[Turn]:
        import httpx

        history: list[dict[str, Any]] = []
        prev = None
        out: list[Turn] = []
        headers = {"authorization": f"Bearer {self.api_key}", "x-session-id": self.session}
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(self.turns):
                stateless = self.mode == "http-stateless"
                history += new_items
                body = self._body(history if stateless else new_items, None if stateless else prev)
                seen = await http_turn(client, self.base, body, headers=headers, keep_events=False)
                if not seen.ok:
                    raise RuntimeError(f"turn {i} failed: {seen.events[-1] if seen.events else None}")
                resp = seen.response
                out.append(self._turn(i, resp, seen))
                if stateless:
                    history += [_as_input(o) for o in resp["output"]]
                prev = resp["id"]
                new_items = self._next_items(i, resp["output"])
                if self.delay:
                    await asyncio.sleep(self.delay)
        return out

    async def _run_ws(self, new_items: list[dict[str, Any]]) -> list[Turn]:
        from websockets.asyncio.client import connect

        out: list[Turn] = []
        async with connect(ws_url(self.base), open_timeout=60, max_size=None, compression=None,
                           additional_headers={"authorization": f"Bearer {self.api_key}",
                                               "x-session-id": self.session}) as ws:
            prev = None
            for i in range(self.turns):
                seen = await ws_turn(ws, self._body(new_items, prev), keep_events=False)
                if not seen.ok:
                    raise RuntimeError(f"turn {i} failed: {seen.events[-1] if seen.events else None}")
                resp = seen.response
                out.append(self._turn(i, resp, seen))
                prev = resp["id"]
                new_items = self._next_items(i, resp["output"])
                if self.delay:
                    await asyncio.sleep(self.delay)
        return out

    def _turn(self, i: int, resp: dict[str, Any], seen: ClientTurn) -> Turn:
        if self.progress:
            self.progress(self.mode, i + 1, self.turns)
        usage = resp.get("usage") or {}
        return Turn(i + 1, resp["id"], seen.wall_s, seen.first_event_s, seen.first_token_s, seen.sent_bytes,
                    usage.get("input_tokens", 0),
                    (usage.get("input_tokens_details") or {}).get("cached_tokens", 0))


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return {k: v for k, v in item.items() if k in ("type", "call_id", "name", "arguments", "id")}


def progress_bar(mode: str, done: int, total: int) -> None:
    width = 30
    filled = int(width * done / total)
    sys.stderr.write(f"\r{mode:15s} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def attach_server_timings(base_url: str, turns: list[Turn]) -> None:
    """Join each turn with the server's own timing (`/loopserve/stats`)."""
    from cluster.bench.local import stats as server_stats

    stats = server_stats(base_url.rstrip("/"), last=1024)
    by_id = {t["response_id"]: t for t in stats["turns"]}
    for t in turns:
        t.server = by_id.get(t.response_id, {})


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = min(len(v) - 1, max(0, round(p / 100 * (len(v) - 1))))
    return v[k]


def summarize(mode: str, turns: list[Turn]) -> dict[str, Any]:
    over = [t.overhead_s for t in turns if t.overhead_s is not None]
    first_10 = [t.overhead_s for t in turns[1:11] if t.overhead_s is not None]
    last_10 = [t.overhead_s for t in turns[-10:] if t.overhead_s is not None]
    return {
        "mode": mode,
        "turns": len(turns),
        "loop_s": sum(t.wall_s for t in turns),
        # the engine's own time (prefill of uncached tokens + decode), from the engine replica's clock
        "engine_s": sum(t.server.get("engine_inner", 0.0) for t in turns),
        "split_p50_ms": {k: percentile([t.split()[k] for t in turns if t.server], 50) * 1000
                         for k in ("outside_server", "connection", "render", "safety_input", "engine_hop",
                                   "engine_dispatch")},
        "first_event_p50_ms": percentile([t.first_event_s for t in turns], 50) * 1000,
        "first_event_p99_ms": percentile([t.first_event_s for t in turns], 99) * 1000,
        "first_token_p50_ms": percentile([t.first_token_s for t in turns], 50) * 1000,
        "first_token_p99_ms": percentile([t.first_token_s for t in turns], 99) * 1000,
        "overhead_p50_ms": percentile(over, 50) * 1000,
        "overhead_p99_ms": percentile(over, 99) * 1000,
        "overhead_early_ms": percentile(first_10, 50) * 1000,
        "overhead_late_ms": percentile(last_10, 50) * 1000,
        "bytes_sent_total": sum(t.bytes_sent for t in turns),
        "final_input_tokens": turns[-1].input_tokens if turns else 0,
        "per_turn": [{**{k: v for k, v in asdict(t).items() if k != "server"}, "overhead_s": t.overhead_s,
                      "split_s": t.split()} for t in turns],
    }
