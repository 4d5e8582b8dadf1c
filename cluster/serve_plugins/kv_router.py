"""Engine placement on KV headroom, sticky afterwards: Ray Serve's consistent-hash router plus
a new session's choice of the engine replica with the most room in its KV budget.

Each engine replica reports its KV headroom (capacity - running - retained - queued tokens)
and the tokens a session typically holds there through Serve's routing stats
(`EngineReplica.record_routing_stats`, polled by the controller every
`request_routing_stats_period_s`). Between two polls this router counts its own placements
against a replica's headroom (a burst of new sessions would otherwise herd onto the one that
looked emptiest). A session this router has not placed goes to its consistent-hash replica
unless another replica has clearly more headroom (more than `HEADROOM_SLACK` of a replica's
capacity more): affinity first, bounded by load.

One placement truth across connection replicas: a continuation's session id may name the
replica its chain last ran on (`key@replica`, `PLACEMENT_SEP`; recorded with the chain's state
and in the store). That replica is chosen whenever it is alive, whichever router sees the turn;
the ring hashes only the key. A named replica that is gone hands the session back: it is placed
again like a new one. A session the engine moved (no room for too long) comes back under a new
routing key and is placed again, away from the full replica.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Optional

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

HEADROOM_SLACK = 0.1  # of a replica's KV capacity: less difference than this keeps the ring's choice
MAX_PLACED = 100_000
PLACEMENT_SEP = "@"  # session id = routing key, then optionally "@" and the replica the chain is on


def split_placement(session_id: str) -> tuple[str, str]:
    """(routing key, named replica or "")."""
    key, _, replica = session_id.partition(PLACEMENT_SEP)
    return key, replica


def choose_by_headroom(ring: List[Any], stats: dict[Any, dict[str, Any]],
                       placed_since: Optional[dict[Any, int]] = None) -> List[Any]:
    """The ring's order (primary first), with the replica of most KV headroom first when it has
    clearly more than the primary. Replicas without stats keep their ring position. A replica's
    headroom is reduced by the sessions this router placed there since its stats were taken
    (`placed_since`), each at the tokens a session typically holds there."""
    if not ring:
        return ring
    known = [r for r in ring if "kv_headroom" in stats.get(r, {})]
    if not known:
        return ring
    placed_since = placed_since or {}

    def headroom(r: Any) -> float:
        s = stats[r]
        per_session = float(s.get("kv_session_tokens") or 0.0)
        return float(s["kv_headroom"]) - placed_since.get(r, 0) * per_session

    best = max(known, key=headroom)
    primary = ring[0]
    slack = HEADROOM_SLACK * float(stats.get(best, {}).get("kv_capacity") or 0)
    if primary in known and headroom(best) - headroom(primary) <= slack:
        return ring
    return [best] + [r for r in ring if r != best]


class KvPlacementRouter(ConsistentHashRouter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._placed: OrderedDict[str, Any] = OrderedDict()  # session id -> replica id
        # replica id -> (the stats those placements are counted against, sessions placed since)
        self._since: dict[Any, tuple[Any, int]] = {}

    def _routing_key(self, pending_request: Optional[Any]) -> Optional[str]:
        key = super()._routing_key(pending_request)
        return split_placement(key)[0] if key else key  # the ring hashes the key, never the named replica

    def _placed_since(self, stats: dict[Any, dict[str, Any]]) -> dict[Any, int]:
        out = {}
        for rid, (seen, n) in list(self._since.items()):
            if stats.get(rid, {}).get("kv_stats_seq") != seen:
                del self._since[rid]  # fresh stats include those placements
            else:
                out[rid] = n
        return out

    def _count_placement(self, rid: Any, stats: dict[Any, dict[str, Any]]) -> None:
        seq = stats.get(rid, {}).get("kv_stats_seq")
        seen, n = self._since.get(rid, (seq, 0))
        self._since[rid] = (seq, n + 1 if seen == seq else 1)

    async def choose_replicas(self, candidate_replicas: List[Any], pending_request: Optional[Any] = None):
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        session_id = pending_request.metadata.session_id if pending_request is not None else None
        if not session_id or not ranks or len(candidate_replicas) < 2:
            return ranks
        session, named = split_placement(session_id)
        by_id = {r.replica_id: r for r in candidate_replicas}
        if named:
            chain_replica = next((rid for rid in by_id if getattr(rid, "unique_id", None) == named), None)
            if chain_replica is not None:  # the chain's prefix is there: one truth for every router
                self._placed[session] = chain_replica
                self._placed.move_to_end(session)
                return [[by_id[chain_replica]]] + [r for r in ranks if r[0].replica_id != chain_replica]
            self._placed.pop(session, None)  # its replica is gone: handed back, placed again below
        placed = self._placed.get(session)
        if placed is not None and placed in self._replicas:
            self._placed.move_to_end(session)
            return [[self._replicas[placed]]] + [r for r in ranks if r[0].replica_id != placed]
        ring = [rank[0].replica_id for rank in ranks]
        ring += [rid for rid in by_id if rid not in ring]  # every replica may take a new session
        stats = {rid: dict(r.routing_stats or {}) for rid, r in by_id.items()}
        order = choose_by_headroom(ring, stats, self._placed_since(stats))
        self._placed[session] = order[0]
        self._count_placement(order[0], stats)
        while len(self._placed) > MAX_PLACED:
            self._placed.popitem(last=False)
        return [[by_id[rid]] for rid in order[: 1 + self._num_fallback_replicas] if rid in by_id]
