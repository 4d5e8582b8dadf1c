"""How the KV budget ends retention early: for a waiting turn, for a tenant over its share.

A mixin of `KvBudget` (`kv_budget.py`), split out to keep each file readable; it reads and
changes the budget's holds only through `_change`, so the running totals stay exact.
"""

from __future__ import annotations

from typing import Any

from cluster.engines.kv_policy import SessionHold, Waiter


class Evictions:
    # What the budget has (set by `KvBudget`'s dataclass fields).
    sessions: Any
    queue: Any
    counters: Any
    capacity: int
    policy: Any
    dropped: list
    unpinning: dict
    _tenant_retained: Any
    def _end_retention(self, key: str, hold: SessionHold) -> None:
        self.unpinning[key] = hold.retained  # the engine holds them until its unpin is delivered
        self._change(hold, retained=0)
        hold.released = True
        hold.soft = False
        self.dropped.append(key)

    def _evict_soft_for(self, waiter: Waiter, hold: SessionHold) -> None:
        """Soft retentions (a chain that may come back but gave no sign) give their room to a
        waiting turn at once, least recently used first."""
        queued = {w.session for w in self.queue.values()}
        for key, victim in list(self.sessions.items()):
            if self._fits(hold, waiter.need):
                return
            if victim.soft and victim.idle_retained and key not in queued and key != waiter.session:
                self._end_retention(key, victim)
                self.counters.evicted += 1
                self.counters.evicted_soft += 1

    def _evict_for(self, waiter: Waiter, hold: SessionHold) -> None:
        # Idle sessions first (least recently used first); then sessions whose turn waits
        # behind this one, the newest waiter first: those ahead of it keep their place.
        waiting = list(self.queue.values())
        at = next(i for i, w in enumerate(waiting) if w.ticket == waiter.ticket)
        behind = {w.session: i for i, w in enumerate(waiting) if i > at}
        queued = {w.session for w in waiting}
        # (a lifetime its client declared keeps a session's place longest among the idle)
        candidates = [(0, bool(h.min_ttl), h.finished_at or 0.0, k) for k, h in self.sessions.items()
                      if h.retained and not h.turns and k not in queued]
        candidates += [(1, False, -i, k) for k, i in behind.items() if k != waiter.session
                       and self.sessions[k].retained and not self.sessions[k].turns]
        for *_, key in sorted(candidates):
            if self._fits(hold, waiter.need, spare=False):
                return
            self._end_retention(key, self.sessions[key])
            self.counters.evicted += 1

    def _cap_tenant(self, tenant: str) -> None:
        """One tenant's retained prefixes hold at most `tenant_share` of the capacity: its least
        recently used ones go first."""
        limit = self.policy.tenant_share * self.capacity
        if self._tenant_retained[tenant] <= limit:
            return
        for key, h in list(self.sessions.items()):
            if self._tenant_retained[tenant] <= limit:
                break
            if h.tenant == tenant and h.idle_retained:
                self._end_retention(key, h)
                self.counters.over_share += 1
