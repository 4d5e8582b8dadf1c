"""64 hostile clients at once (the hardening target: every bound holds together), seen from outside: every bound of items 1-5
together, over WebSocket and HTTP, while honest sessions go on.

Each attacking socket starts a long response, then: steers it with ~0.9 MB inputs past the
steering bound (item 4), queues ~0.9 MB creates past the queue's byte bound (item 5's sibling:
what waits in the queue), sends creates with over-long names (item 2) and with 300 item
references (item 3), and ends with a flood of one-byte invalid frames it does not read (item 1).
Over HTTP, 64 requests carry 2 MB names and 200 KB `input_tokens` bodies with truncation
(items 2 and 8). The documented ceiling (README, "Behaviour worth knowing") is what one socket
can make a replica hold, `max_queued_bytes + 4 MiB of steering + 16 MiB of injected output +
max_frame_bytes`, times the sockets; the connection replica's peak RSS must stay under it
(twice it, for Python's object overhead, plus the replica's own baseline), honest sessions'
turns must all complete, and the replica must answer normally afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.support.local_cluster import stats as server_stats
from cluster.core.websocket.agent import MAX_INJECTED_BYTES
from cluster.core.websocket.steering import MAX_STEER_BYTES
from tests.support.apps import module_app, scripted_app
from tests.support.ws import TERMINAL, ws_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(720)]
SOCKETS = 64
FRAME = 1024 * 1024
QUEUE = 4 * 1024 * 1024
ANSWER_WITHIN = 240  # seconds after its last frame


@pytest.fixture(scope="module")
def hostile_url(serve_instance):
    args = scripted_app({"tokens_per_second": 400}, safety={"enabled": True},
                        websocket={"max_frame_bytes": FRAME, "max_queued_bytes": QUEUE},
                        connection={"max_ongoing_requests": 200})
    yield from module_app("hostile", "/hostile", args, serve_instance, 180)


def create(text: str, **kw) -> str:
    return json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False, "input": text, **kw})


async def attacker(url: str, n: int) -> dict:
    seen: dict[str, int] = {}
    big = "y" * (FRAME - 100 * 1024)
    try:
        async with connect(url, max_size=None, open_timeout=60, close_timeout=5) as ws:
            await ws.send(create(f"attacker {n}: a long answer please", max_output_tokens=2000))
            rid = None
            while rid is None:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if ev["type"] == "response.created":
                    rid = ev["response"]["id"]
            for _ in range(5):  # ~4.6 MB of steering against a 4 MiB bound
                await ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid,
                                          "input": [{"type": "message", "role": "user", "content": big}]}))
            for _ in range(5):  # ~4.6 MB of queued creates against a 4 MiB queue
                await ws.send(create(big))
            await ws.send(create("x", model="m" * 5000, user="u" * 100_000))
            await ws.send(create("x", input=[{"type": "item_reference", "id": "msg_nope"}] * 300))
            for _ in range(2000):  # invalid frames, none of whose errors it reads
                await ws.send("x")
            await asyncio.sleep(2)
            # Read until the server has answered this attacker (a refusal or an error; a close is
            # caught below), however long the ~900 MB the 64 sockets sent take to read: a CI run
            # gave up after 10 quiet seconds and failed; a run here had 60 of 64 sockets quiet for
            # over 10 s, the slowest answered 24 s after its last frame. The deadline bounds a hang.
            # Then read what else the server kept for it, until it has nothing more.
            t0 = time.monotonic()
            answered = False
            while True:
                wait = 10 if answered else t0 + ANSWER_WITHIN - time.monotonic()
                try:
                    raw = await asyncio.wait_for(ws.recv(), max(wait, 0.1))
                except asyncio.TimeoutError:
                    break
                kind = json.loads(raw)["type"]
                seen[kind] = seen.get(kind, 0) + 1
                if not answered and kind in ("error", "response.steer.failed"):
                    answered = True
                    seen["answered_after_s"] = round(time.monotonic() - t0)
    except Exception as exc:  # closed by the server (1008 too_many_errors is one right answer)
        seen[f"closed:{type(exc).__name__}"] = 1
    return seen


async def http_attacker(base: str, client: httpx.AsyncClient) -> list[int]:
    codes = []
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/responses", json={"model": "loopserve-tiny", "input": "x",
                                                        "user": "u" * 2_000_000, "prompt_cache_key": "k" * 2_000_000})
    codes.append(r.status_code)
    r = await client.post(base + "/v1/responses/input_tokens", json={
        "model": "loopserve-tiny", "truncation": "auto",
        "input": [{"type": "message", "role": "user", "content": "word " * 40_000}]})
    codes.append(r.status_code)
    codes.append(time.perf_counter() - t0)  # how long the pair took under the attack (printed)
    return codes


async def honest(url: str, turns: int) -> list[float]:
    latencies = []
    async with connect(url, open_timeout=60) as ws:
        prev = None
        for i in range(turns):
            t0 = time.perf_counter()
            await ws.send(create(f"step {i}: read the file", max_output_tokens=16,
                                 **({"previous_response_id": prev} if prev else {})))
            while (ev := json.loads(await asyncio.wait_for(ws.recv(), 240)))["type"] not in (*TERMINAL, "error"):
                pass
            # (16 tokens: the scripted answer is longer, so a full turn ends at max_output_tokens)
            assert ev["type"] in ("response.completed", "response.incomplete"), ev
            assert ev["response"]["status"] == "completed" or \
                ev["response"]["incomplete_details"]["reason"] == "max_output_tokens", ev
            prev = ev["response"]["id"]
            latencies.append(time.perf_counter() - t0)
    return latencies


async def test_sixty_four_hostile_clients_stay_under_the_ceiling_and_honest_sessions_go_on(hostile_url):
    url = ws_url(hostile_url)
    before = await asyncio.to_thread(server_stats, hostile_url)
    baseline_latency = await honest(url, 3)
    # 64 x 4 MB HTTP bodies arrive together with ~900 MB of WebSocket attack on 2 shared cores: a
    # CI run saw one answer take over 120 s. The wait bounds a hang, not the speed.
    async with httpx.AsyncClient(timeout=360) as client:
        honest_sessions = [asyncio.create_task(honest(url, 15)) for _ in range(2)]
        attacks = [asyncio.create_task(attacker(url, n)) for n in range(SOCKETS)]
        http = [asyncio.create_task(http_attacker(hostile_url, client)) for _ in range(SOCKETS)]
        seen = await asyncio.wait_for(asyncio.gather(*attacks), ANSWER_WITHIN + 180)
        codes = await asyncio.gather(*http)
        latencies = [x for lat in await asyncio.gather(*honest_sessions) for x in lat]
    after = await asyncio.to_thread(server_stats, hostile_url)

    # The same replica served throughout: its loop kept answering Serve's health checks (a CI run
    # saw Serve replace it mid-attack, dropping an honest socket, while it tokenized ~1 MB steers).
    assert after["pid"] == before["pid"], "Serve replaced the connection replica during the attack"
    # HTTP: the over-long names are a 400; token counting is admitted and bounded (200 or 400)
    assert all(c[0] == 400 for c in codes), codes[:3]
    assert all(c[1] in (200, 400, 429) for c in codes), codes[:3]
    # every attacker was answered within ANSWER_WITHIN: its steers or creates refused, or its socket closed
    unanswered = [s for s in seen if not (s.get("response.steer.failed") or s.get("error")
                                          or any(k.startswith("closed:") for k in s))]
    assert not unanswered, (len(unanswered), unanswered[:5])
    # honest sessions: every turn completed (each event within honest()'s 240 s wait). How long they
    # took under the attack is printed, not asserted: on 2 shared cores the slowest took 27-62 s.
    assert len(latencies) == 30, latencies
    # the connection replica held no more than the documented ceiling
    per_socket = QUEUE + MAX_STEER_BYTES + MAX_INJECTED_BYTES + FRAME
    grew = after["peak_rss_bytes"] - before["rss_bytes"]
    print(f"peak RSS growth {grew / 2**20:.0f} MiB; ceiling {2 * SOCKETS * per_socket / 2**20:.0f} MiB; "
          f"honest turn p max {max(latencies):.2f} s (alone {max(baseline_latency):.2f} s); "
          f"slowest HTTP attacker {max(c[2] for c in codes):.1f} s; slowest WebSocket attacker answered "
          f"{max(s.get('answered_after_s', 0) for s in seen)} s after its last frame")
    assert grew < 2 * SOCKETS * per_socket, grew
    # and it still answers like before
    assert (await honest(url, 2))[-1] < 30
