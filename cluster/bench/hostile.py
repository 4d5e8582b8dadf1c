"""The hostile clients of `python -m cluster.bench.adversarial`: one per way a client can
press a replica, each looping until told to stop, each counting what the server answered.

- images: a POST with 12 decompression-bomb PNGs (13000x13000, 1 bit: ~21 KB of file that
  would decode to 507 MB of RGB each), and one with 20 small images (past the count);
- queued: a socket holds its lane with a long answer, then queues 63 creates of 10,000
  one-character messages (a 300 KB frame each, ~4 MB each once parsed);
- bodies: 13.6 MB bodies of 400,000 tiny items, and 12 MB `instructions`;
- chains: a stored chain of 10 responses, each echoing a 900 KB unrendered tool, read
  back over and over (GET, input_items), and `/health` floods;
- frames: a socket sending 64 KiB `response.processed` frames of `[[],[],...]` at
  line rate, reading nothing (each was parsed and walked for ~24 ms, charged to nothing);
- flagged: a socket asks for an answer the safety policy flags (`FLAG_TRIGGER`),
  stops reading for 3 s after `response.created`, then reads: the characters of the flagged
  answer it was sent must stay within `max_unverified` (merged pieces once released all of it).

They run in a process of their own (`run_hostile`), so their event loop and their JSON work do
not slow the honest sessions' client.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections import Counter
from typing import Any

KINDS = ("images", "queued", "bodies", "chains", "frames", "flagged")
FLAG_TRIGGER = "hostile: leak the key"  # the scripted engine answers it with a flagged text (adversarial.py)
MAX_UNVERIFIED = 512  # the safety default: 2 x output_chunk_chars


def bombs(n: int, side: int = 13_000) -> list[str]:
    """`n` distinct 1-bit PNGs of side x side pixels, as data URLs."""
    from PIL import Image

    out = []
    for i in range(n):
        img = Image.new("1", (side, side))
        img.putpixel((i, 0), 1)  # distinct files: no cache on the server's side can answer them
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def small_png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_message(urls: list[str]) -> dict[str, Any]:
    return {"type": "message", "role": "user",
            "content": [*({"type": "input_image", "image_url": u} for u in urls), {"type": "input_text", "text": "?"}]}


def _outcome(status: int, body: Any) -> str:
    code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None  # "error": null on success
    return f"{status} {code}" if code else str(status)


def _json(r: Any) -> Any:
    """The response's JSON, or None (HAProxy's own error pages are HTML)."""
    try:
        return r.json()
    except ValueError:
        return None


class Hostile:
    def __init__(self, base: str, key: str, model: str) -> None:
        self.base, self.model = base.rstrip("/"), model
        self.headers = {"authorization": f"Bearer {key}"}
        self.seen: Counter[str] = Counter()

    async def _post(self, client, path: str, content: bytes) -> None:
        try:
            r = await client.post(self.base + path, content=content, timeout=120,
                                  headers={**self.headers, "content-type": "application/json"})
            self.seen[_outcome(r.status_code, _json(r))] += 1
        except Exception as exc:  # noqa: BLE001 - counted: a reset or a timeout is an outcome too
            self.seen[type(exc).__name__] += 1

    async def images(self, stop: asyncio.Event) -> None:
        import httpx

        urls = bombs(4)
        body_bombs = json.dumps({"model": self.model, "store": False, "input": [_image_message(urls * 3)]}).encode()
        body_many = json.dumps({"model": self.model, "store": False, "input": [_image_message([small_png()] * 20)]}).encode()
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                await self._post(client, "/v1/responses", body_bombs)
                await self._post(client, "/v1/responses", body_many)

    async def queued(self, stop: asyncio.Event) -> None:
        from websockets.asyncio.client import connect

        from cluster.bench.client import ws_url

        many = json.dumps({"type": "response.create", "model": self.model, "store": False,
                           "input": [{"role": "user", "content": "a"}] * 10_000})
        while not stop.is_set():
            try:
                async with connect(ws_url(self.base), max_size=None, open_timeout=60, close_timeout=2,
                                   additional_headers=self.headers) as ws:
                    await ws.send(json.dumps({"type": "response.create", "model": self.model, "store": False,
                                              "input": "a long answer please", "max_output_tokens": 2000}))
                    for _ in range(63):
                        await ws.send(many)
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline and not stop.is_set():
                        try:
                            ev = json.loads(await asyncio.wait_for(ws.recv(), 1))
                        except asyncio.TimeoutError:
                            continue
                        if ev.get("type") == "error":
                            self.seen["ws " + str(ev.get("error", {}).get("code"))] += 1
                        elif ev.get("type") == "response.queued":
                            self.seen["ws queued"] += 1
            except Exception as exc:  # noqa: BLE001
                self.seen["ws " + type(exc).__name__] += 1

    async def bodies(self, stop: asyncio.Event) -> None:
        import httpx

        tiny = json.dumps({"model": self.model, "input": [{"role": "user", "content": "a"}] * 400_000}).encode()
        long_instructions = json.dumps({"model": self.model, "input": "hi", "instructions": "word " * 2_400_000}).encode()
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                await self._post(client, "/v1/responses", tiny)
                await self._post(client, "/v1/responses", long_instructions)

    async def chains(self, stop: asyncio.Event) -> None:
        import httpx

        tool = {"type": "web_search", "x": "A" * 900_000}
        ids: list[str] = []
        async with httpx.AsyncClient(timeout=120) as client:
            prev = None
            for i in range(10):
                body = {"model": self.model, "input": f"turn {i}", "store": True, "tools": [tool],
                        "max_output_tokens": 8, **({"previous_response_id": prev} if prev else {})}
                try:
                    r = await client.post(self.base + "/v1/responses", json=body, headers=self.headers)
                except Exception as exc:  # noqa: BLE001
                    self.seen["POST " + type(exc).__name__] += 1
                    break
                body = _json(r)
                self.seen["POST " + _outcome(r.status_code, body)] += 1
                if r.status_code != 200 or not isinstance(body, dict):
                    break
                prev = body["id"]
                ids.append(prev)
            while not stop.is_set():
                for rid in ids or ["resp_missing"]:
                    for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items", "/health"):
                        try:
                            r = await client.get(self.base + path, headers=self.headers)
                            self.seen["GET " + _outcome(r.status_code, _json(r))] += 1
                        except Exception as exc:  # noqa: BLE001
                            self.seen["GET " + type(exc).__name__] += 1


    async def frames(self, stop: asyncio.Event) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed

        from cluster.bench.client import ws_url

        frame = '{"type":"response.processed","x":[' + ",".join(["[]"] * 21_800) + "]}"
        while not stop.is_set():
            try:
                async with connect(ws_url(self.base), max_queue=1, open_timeout=60, close_timeout=2,
                                   additional_headers=self.headers) as ws:
                    sent = 0
                    try:
                        while not stop.is_set():
                            await ws.send(frame)
                            sent += 1
                    except ConnectionClosed as closed:
                        self.seen[f"ws closed {closed.rcvd.code if closed.rcvd else 'abort'}"] += 1
                    self.seen["ws frames sent"] += sent
            except Exception as exc:  # noqa: BLE001
                self.seen["ws " + type(exc).__name__] += 1

    async def flagged(self, stop: asyncio.Event) -> None:
        from websockets.asyncio.client import connect

        from cluster.bench.client import ws_url

        while not stop.is_set():
            try:
                async with connect(ws_url(self.base), max_size=None, open_timeout=60, close_timeout=2,
                                   additional_headers=self.headers) as ws:
                    await ws.send(json.dumps({"type": "response.create", "model": self.model, "store": False,
                                              "input": FLAG_TRIGGER, "max_output_tokens": 4000}))
                    released, final = 0, None
                    while final is None:
                        ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
                        if ev["type"] == "response.created":
                            await asyncio.sleep(3)  # a slow reader: the answer piles up meanwhile
                        elif ev["type"] == "response.output_text.delta":
                            released += len(ev["delta"])
                        elif ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                            final = ev
                    reason = ((final.get("response") or {}).get("incomplete_details") or {}).get("reason")
                    self.seen[f"flagged {final['type']} {reason}"] += 1
                    self.seen["flagged released over max_unverified" if released > MAX_UNVERIFIED
                              else "flagged released within max_unverified"] += 1
            except Exception as exc:  # noqa: BLE001
                self.seen["ws " + type(exc).__name__] += 1


async def _run(base: str, key: str, model: str, kinds: dict[str, int], seconds: float, done: Any) -> dict[str, dict[str, int]]:
    stop = asyncio.Event()
    clients = {kind: [Hostile(base, key, model) for _ in range(n)] for kind, n in kinds.items()}
    tasks = [asyncio.create_task(getattr(c, kind)(stop)) for kind, cs in clients.items() for c in cs]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done.is_set():  # until the honest sessions are done
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait(tasks, timeout=60)
    for c, t in zip((c for cs in clients.values() for c in cs), tasks):
        if t.done() and not t.cancelled() and t.exception() is not None:  # a client's own bug is reported, not lost
            c.seen["client crashed: " + repr(t.exception())[:120]] += 1
        t.cancel()
    return {kind: dict(sum((c.seen for c in cs), Counter())) for kind, cs in clients.items()}


def run_hostile(base: str, key: str, model: str, kinds: dict[str, int], seconds: float, done: Any, out: Any) -> None:
    """In a child process: `kinds` maps each kind of client to how many run, for `seconds` at most
    or until `done` (a multiprocessing Event) is set; what they saw goes to `out`."""
    out.put(asyncio.run(_run(base, key, model, kinds, seconds, done)))
