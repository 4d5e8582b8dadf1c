"""Memory a client controls is bounded replica-wide, seen from outside: a small app whose
connection caches share a 600 KB bound and whose conversations may pin 400 KB each."""


import pytest
from websockets.asyncio.client import connect

from tests.support.local_cluster import stats as server_stats
from tests.support.apps import module_app, scripted_app
from tests.support.ws import turn as ws_turn
from tests.support.ws import ws_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BLOB = "z" * 150_000  # a field the API ignores: kept in memory with its item, never rendered


@pytest.fixture(scope="module")
def limits_url(serve_instance):
    args = scripted_app({"tokens_per_second": 2000}, safety={"enabled": False},
                        cache={"connections_max_bytes": 600_000}, limits={"max_context_bytes": 400_000})
    yield from module_app("limits", "/limits", args, serve_instance, 180)


def item(i: int) -> list[dict]:
    return [{"type": "message", "role": "user", "content": f"step {i}", "client_state": BLOB}]


async def turn(ws, body) -> dict:
    return (await ws_turn(ws, {"store": False, **body}))[-1]


async def test_connection_caches_share_one_replica_bound(limits_url):
    url = ws_url(limits_url)
    async with connect(url) as a, connect(url) as b, connect(url) as c, connect(url) as d:
        last = {}
        for name, ws in (("a", a), ("b", b), ("c", c), ("d", d)):  # a is the least recently used
            ev = await turn(ws, {"input": item(0)})
            assert ev["type"] == "response.completed", ev
            last[name] = ev["response"]["id"]
        s = server_stats(limits_url)
        assert s["ws_cache_bytes"] <= 600_000 + 200_000  # the bound, plus the writer's own latest state
        assert s["ws_cache_reclaimed"] >= 1
        # the oldest connection's state was reclaimed: the documented answer, replay the input
        gone = await turn(a, {"input": item(1), "previous_response_id": last["a"]})
        assert gone["type"] == "error" and gone["error"]["code"] == "previous_response_not_found"
        kept = await turn(d, {"input": item(1), "previous_response_id": last["d"]})
        assert kept["type"] == "response.completed", kept


async def test_one_conversation_cannot_pin_more_than_its_bound(limits_url):
    url = ws_url(limits_url)
    async with connect(url) as ws:
        prev = None
        for i in range(4):  # 150 KB of unrendered payload per turn; the bound is 400 KB
            ev = await turn(ws, {"input": item(i), **({"previous_response_id": prev} if prev else {})})
            if ev["type"] == "error":
                break
            prev = ev["response"]["id"]
        assert i == 2 and ev["error"]["code"] == "context_too_large", (i, ev)
        ok = await turn(ws, {"input": "a fresh, small conversation"})
        assert ok["type"] == "response.completed"
