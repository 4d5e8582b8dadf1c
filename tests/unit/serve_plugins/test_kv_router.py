"""KV placement (cluster/serve_plugins/kv_router.py): a new session's replica, affinity first, bounded by KV headroom."""

from collections import OrderedDict

from cluster.serve_plugins.kv_router import HEADROOM_SLACK, KvPlacementRouter, choose_by_headroom, split_placement


def test_the_ring_keeps_a_new_session_unless_another_replica_has_clearly_more_room():
    ring = ["a", "b", "c"]
    cap = 100_000
    close = {"a": {"kv_headroom": 50_000, "kv_capacity": cap}, "b": {"kv_headroom": 50_000 + HEADROOM_SLACK * cap - 1,
                                                                        "kv_capacity": cap},
             "c": {"kv_headroom": 10_000, "kv_capacity": cap}}
    assert choose_by_headroom(ring, close) == ["a", "b", "c"]
    full = {"a": {"kv_headroom": -5_000, "kv_capacity": cap}, "b": {"kv_headroom": 20_000, "kv_capacity": cap},
            "c": {"kv_headroom": 70_000, "kv_capacity": cap}}
    assert choose_by_headroom(ring, full) == ["c", "a", "b"]


def test_replicas_without_kv_stats_keep_the_ring_order():
    assert choose_by_headroom(["a", "b"], {}) == ["a", "b"]
    assert choose_by_headroom(["a", "b"], {"b": {"kv_headroom": 10, "kv_capacity": 100}}) == ["b", "a"]
    assert choose_by_headroom([], {}) == []


def test_a_routers_own_placements_since_the_last_stats_count_against_a_replicas_headroom():
    cap = 100_000
    stats = {"a": {"kv_headroom": 60_000, "kv_capacity": cap, "kv_session_tokens": 8_000},
             "b": {"kv_headroom": 40_000, "kv_capacity": cap, "kv_session_tokens": 8_000}}
    ring = ["b", "a"]
    assert choose_by_headroom(ring, stats)[0] == "a"
    # a burst: after three placements on a (24,000 tokens counted), b has more room
    assert choose_by_headroom(ring, stats, {"a": 3})[0] == "b"
    assert choose_by_headroom(ring, stats, {"a": 1})[0] == "a"


def test_a_session_id_may_name_the_replica_of_its_chain():
    assert split_placement("abc@r1") == ("abc", "r1")
    assert split_placement("abc") == ("abc", "")


class _Replica:
    def __init__(self, unique_id, headroom):
        self.replica_id = _Id(unique_id)
        self.routing_stats = {"kv_headroom": headroom, "kv_capacity": 1000, "kv_session_tokens": 100,
                              "kv_stats_seq": 1}


class _Id:
    def __init__(self, unique_id):
        self.unique_id = unique_id

    def __repr__(self):
        return self.unique_id


def _router(replicas):
    """The router's placement logic without a Serve controller: the ring is stubbed to list the
    replicas in the given order (a fake of `ConsistentHashRouter.choose_replicas`, which needs a
    running Serve app; the integration and cluster tests run the real one)."""
    router = KvPlacementRouter.__new__(KvPlacementRouter)
    router._placed, router._since, router._num_fallback_replicas = OrderedDict(), {}, 0
    router._replicas = {r.replica_id: r for r in replicas}

    async def ring(self, candidates, pending=None):
        return [[r] for r in candidates]

    return router, ring


def _pending(session_id):
    meta = type("M", (), {"session_id": session_id, "internal_request_id": "x"})()
    return type("P", (), {"metadata": meta})()


def test_every_router_sends_a_chain_to_its_replica_and_a_gone_replica_hands_it_back(monkeypatch):
    import asyncio

    from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

    a, b = _Replica("ra", 100), _Replica("rb", 900)
    router, ring = _router([a, b])
    monkeypatch.setattr(ConsistentHashRouter, "choose_replicas", ring)
    choose = lambda sid, cands: asyncio.run(router.choose_replicas(cands, _pending(sid)))[0][0]
    # new: b has the room
    assert choose("s1", [a, b]) is b
    # a router that never saw s1, told its chain is on a: a, although b has more room
    other, _ = _router([a, b])
    assert asyncio.run(other.choose_replicas([a, b], _pending("s1@ra")))[0][0] is a
    # the named replica left: placed again by headroom, and remembered
    c = _Replica("rc", 50)
    router._replicas = {r.replica_id: r for r in (b, c)}
    assert choose("s2@ra", [c, b]) is b
    assert router._placed["s2"] is b.replica_id
