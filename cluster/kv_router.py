"""Engine placement on KV headroom, sticky afterwards: Ray Serve's consistent-hash router plus
a new session's choice of the engine replica with the most room in its KV budget.

Each engine replica reports its KV headroom (capacity - running - retained - queued tokens)
through Serve's routing stats (`EngineReplica.record_routing_stats`, polled by the
controller every `request_routing_stats_period_s`). A session this router has not placed
goes to its consistent-hash replica unless another replica has clearly more headroom
(more than `HEADROOM_SLACK` of a replica's capacity more): affinity first, bounded by
load. Once placed, a session stays where it was placed (one entry per session, LRU), so
its prefix KV is reused; a replica that goes away sends its sessions back to the ring.
A session the engine moved (`cluster.serving.clients.EngineClient`, no room for too long)
comes back under a new routing key and is placed again, away from the full replica.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Optional

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

HEADROOM_SLACK = 0.1  # of a replica's KV capacity: less difference than this keeps the ring's choice
MAX_PLACED = 100_000


def choose_by_headroom(ring: List[Any], stats: dict[Any, dict[str, Any]]) -> List[Any]:
    """The ring's order (primary first), with the replica of most KV headroom first when it has
    clearly more than the primary. Replicas without stats keep their ring position."""
    if not ring:
        return ring
    known = [r for r in ring if "kv_headroom" in stats.get(r, {})]
    if not known:
        return ring
    best = max(known, key=lambda r: stats[r]["kv_headroom"])
    primary = ring[0]
    slack = HEADROOM_SLACK * float(stats.get(best, {}).get("kv_capacity") or 0)
    if primary in known and stats[best]["kv_headroom"] - stats[primary]["kv_headroom"] <= slack:
        return ring
    return [best] + [r for r in ring if r != best]


class KvPlacementRouter(ConsistentHashRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._placed: OrderedDict[str, Any] = OrderedDict()  # session id -> replica id

    async def choose_replicas(self, candidate_replicas: List[Any], pending_request: Optional[Any] = None):
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        session = pending_request.metadata.session_id if pending_request is not None else None
        if not session or not ranks or len(candidate_replicas) < 2:
            return ranks
        placed = self._placed.get(session)
        if placed is not None and placed in self._replicas:
            self._placed.move_to_end(session)
            return [[self._replicas[placed]]] + [r for r in ranks if r[0].replica_id != placed]
        by_id = {r.replica_id: r for r in candidate_replicas}
        ring = [rank[0].replica_id for rank in ranks]
        ring += [rid for rid in by_id if rid not in ring]  # every replica may take a new session
        stats = {rid: dict(r.routing_stats or {}) for rid, r in by_id.items()}
        order = choose_by_headroom(ring, stats)
        self._placed[session] = order[0]
        while len(self._placed) > MAX_PLACED:
            self._placed.popitem(last=False)
        return [[by_id[rid]] for rid in order[: 1 + self._num_fallback_replicas] if rid in by_id]
