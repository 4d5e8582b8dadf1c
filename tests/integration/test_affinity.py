"""Session-affine engine routing: every turn of a session on one engine replica."""

import asyncio
import json
import os
import time

import psutil
import pytest
import ray
from websockets.asyncio.client import connect

from tests.support.local_cluster import stats as server_stats
from tests.support.ws import TERMINAL as RESPONSE_ENDS
from tests.support.ws import ws_url

pytestmark = pytest.mark.integration
TERMINAL = (*RESPONSE_ENDS, "error")  # or a refusal before the response


async def run_session(url: str, turns: int, tag: str, ws=None):
    """One agent session on one socket; returns [(response id, usage)] per turn."""
    out = []
    async with connect(ws_url(url), open_timeout=20) as ws:
        prev = None
        for turn in range(turns):
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                      "previous_response_id": prev,
                                      "input": [{"role": "user", "content": f"{tag} turn {turn} " + "words " * 40}]}))
            while (ev := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] not in TERMINAL:
                pass
            assert ev["type"] == "response.completed", ev
            prev = ev["response"]["id"]
            out.append((prev, ev["response"]["usage"]))
    return out


def replicas_of(url: str) -> dict[str, str]:
    stats = server_stats(url, last=1024)
    return {t["response_id"]: t["engine_replica"] for t in stats["turns"]}


async def test_twenty_sessions_by_ten_turns_each_stay_on_one_replica(affinity_url):
    sessions = await asyncio.gather(*[run_session(affinity_url, 10, f"s{k}") for k in range(20)])
    replica_of = replicas_of(affinity_url)
    used = set()
    for turns in sessions:
        replicas = {replica_of[rid] for rid, _ in turns}
        assert len(replicas) == 1, replicas
        used |= replicas
        cached = [u["input_tokens_details"]["cached_tokens"] for _, u in turns]
        inputs = [u["input_tokens"] for _, u in turns]
        assert cached[0] == 0
        # each continuation reuses at least the whole previous prompt
        for k in range(1, len(turns)):
            assert cached[k] >= inputs[k - 1], (k, cached, inputs)
    assert len(used) == 3, "sessions should spread over all replicas"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_replica(unique_id: str) -> None:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if unique_id in actor["name"] and "EngineReplica" in actor["name"]:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            pid = ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
            ray.kill(handle, no_restart=True)
            # ray.kill returns before the process is gone, and Ray may report the actor dead
            # while its process still serves its direct channel: the next turn must come after
            # the process is gone (a turn racing it streams from the dying replica and fails).
            for _ in range(200):
                if _gone(pid):
                    return
                time.sleep(0.05)
            raise AssertionError(f"replica {unique_id} (pid {pid}) did not die")
    raise AssertionError(f"no replica actor named with {unique_id}")


async def test_killing_a_replica_moves_its_sessions_and_their_next_turn_completes(affinity_url):
    url = ws_url(affinity_url)
    moves_before = server_stats(affinity_url)["session_moves"]
    async with connect(url, open_timeout=20) as ws:
        async def turn(prev, text):
            await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                      "previous_response_id": prev, "input": text}))
            while (ev := json.loads(await asyncio.wait_for(ws.recv(), 90)))["type"] not in TERMINAL:
                pass
            assert ev["type"] == "response.completed", ev
            return ev["response"]

        r1 = await turn(None, "first " * 50)
        r2 = await turn(r1["id"], "second " * 50)
        victim = replicas_of(affinity_url)[r2["id"]]
        assert r2["usage"]["input_tokens_details"]["cached_tokens"] > 0
        _kill_replica(victim)
        r3 = await turn(r2["id"], "third " * 50)
        r4 = await turn(r3["id"], "fourth " * 50)
    replica_of = replicas_of(affinity_url)
    assert replica_of[r3["id"]] != victim
    # the moved session re-prefilled once on its new replica, then is cached again
    assert r3["usage"]["input_tokens_details"]["cached_tokens"] == 0
    if replica_of[r4["id"]] == replica_of[r3["id"]]:
        assert r4["usage"]["input_tokens_details"]["cached_tokens"] >= r3["usage"]["input_tokens"]
    else:
        # Serve's replacement replica joined the ring and took this session's
        # hash range (consistent hashing moves ~1/N of sessions to a new node).
        assert r4["usage"]["input_tokens_details"]["cached_tokens"] == 0
    stats = server_stats(affinity_url)
    assert stats["session_moves"] >= moves_before + 1


async def concurrent_first_turns(url: str, rounds: int) -> None:
    """Each round: a new socket (a new session) whose first two turns start together on two
    lanes, then a second turn on each lane; every response must end."""
    for n in range(rounds):
        async with connect(ws_url(url), open_timeout=20) as ws:
            for k in range(2):
                for lane in ("left", "right"):
                    await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": False,
                                              "input": f"{lane} {n}.{k}", "stream_id": lane}))
            ended = []
            while len(ended) < 4:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if ev["type"] in TERMINAL:
                    assert ev["type"] == "response.completed", ev
                    ended.append(ev["stream_id"])
            assert sorted(ended) == ["left", "left", "right", "right"]


async def test_concurrent_first_turns_of_a_session_are_all_routed(scripted_url):
    """Two lanes of a new socket start their first turns together, on the session-affine router:
    one placement call per session (Ray's ConsistentHashRouter left a concurrent same-session
    request unrouted: the second lane hung)."""
    await concurrent_first_turns(scripted_url, 12)


@pytest.fixture(scope="module")
def handle_path_url(serve_instance):
    """Session affinity with the direct engine channel off: every turn is a Serve handle stream."""
    from tests.support.apps import module_app, scripted_app

    args = scripted_app({"tokens_per_second": 100, "max_output_tokens": 128}, routing={"policy": "session_affinity"})
    args["engine"]["direct_stream"] = False
    yield from module_app("handlepath", "/handlepath", args, serve_instance, 240)


async def test_concurrent_same_session_handle_streams_are_all_routed(handle_path_url):
    await concurrent_first_turns(handle_path_url, 5)
    assert server_stats(handle_path_url)["engine_calls"]["direct_turns"] == 0
