"""KV placement (cluster/kv_router.py): a new session's replica, affinity first, bounded by KV headroom."""

from cluster.kv_router import HEADROOM_SLACK, choose_by_headroom


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
