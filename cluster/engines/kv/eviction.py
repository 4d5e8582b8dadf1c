"""How the KV budget ends retention: when it expires, and early: for a waiting turn, for a
tenant over its share.

A mixin of `KvBudget` (`kv/budget.py`), split out to keep each file readable; it reads and
changes the budget's holds only through `_change`, so the running totals stay exact.
"""

from __future__ import annotations

import heapq
from typing import Any, Optional

from cluster.engines.kv.policy import SessionHold, Waiter


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
    _idle: Any  # sessions retained between turns, least recently used first (kv_accounting.Totals)
    _waiting: Any  # session -> its turns waiting in the queue
    _tenant_queued: Any  # tenant -> its turns waiting in the queue
    _expiries: list  # (expiry, seq, session) heap
    _seq: Any

    def _schedule_expiry(self, hold: SessionHold) -> None:
        heapq.heappush(self._expiries, (hold.expires_at, next(self._seq), hold.key))
        if len(self._expiries) > 2 * len(self._idle) + 1024:  # mostly stale: rebuild from the live ones
            self._expiries = [(self.sessions[k].expires_at, next(self._seq), k) for k in self._idle]
            heapq.heapify(self._expiries)

    def _live_expiry(self, entry: tuple) -> Optional[SessionHold]:
        hold = self.sessions.get(entry[2])
        return hold if hold is not None and hold.idle_retained and hold.expires_at == entry[0] else None

    def _next_expiry(self) -> Optional[float]:
        """The soonest retention expiry of a session whose turn does not wait (it keeps its place)."""
        aside, found = [], None
        while self._expiries:
            entry = self._expiries[0]
            if self._live_expiry(entry) is None:
                heapq.heappop(self._expiries)  # stale: it came back, or its retention ended otherwise
            elif self._waiting[entry[2]]:
                aside.append(heapq.heappop(self._expiries))
            else:
                found = entry[0]
                break
        for entry in aside:
            heapq.heappush(self._expiries, entry)
        return found

    def _expire(self, now: float) -> None:
        aside = []  # a session whose turn waits is back: it keeps its place
        while self._expiries and self._expiries[0][0] <= now:
            entry = heapq.heappop(self._expiries)
            hold = self._live_expiry(entry)
            if hold is None:
                continue
            if self._waiting[entry[2]]:
                aside.append(entry)
                continue
            self._end_retention(entry[2], hold)
            self.counters.expired += 1
        for entry in aside:
            heapq.heappush(self._expiries, entry)

    def _end_retention(self, key: str, hold: SessionHold) -> None:
        self.unpinning[key] = hold.retained  # the engine holds them until its unpin is delivered
        self._change(hold, retained=0)
        hold.released = True
        hold.soft = False
        self.dropped.append(key)

    def _evict_soft_for(self, waiter: Waiter, hold: SessionHold) -> None:
        """Soft retentions (a chain that may come back but gave no sign) give their room to a
        waiting turn at once, least recently used first."""
        for key in list(self._idle):
            if self._fits(hold, waiter.need):
                return
            victim = self.sessions[key]
            if victim.soft and key not in self._waiting and key != waiter.session:
                self._end_retention(key, victim)
                self.counters.evicted += 1
                self.counters.evicted_soft += 1

    def fair_share(self, extra_tenant: Optional[str] = None) -> float:
        """Each tenant's even part of the capacity, among the tenants holding retained prefixes
        or waiting here (and `extra_tenant`)."""
        tenants = set(self._tenant_retained) | set(self._tenant_queued)
        if extra_tenant is not None:
            tenants.add(extra_tenant)
        return self.capacity / max(1, len(tenants))

    def _evict_over_share_for(self, waiter: Waiter, hold: SessionHold) -> None:
        """A waiting turn of a tenant under its fair share takes room from the idle retained
        sessions of tenants over theirs, least recently used first, at once: one key's retention
        cannot keep another key's new session waiting (for a TTL or the queue's wait bound)."""
        fair = self.fair_share(waiter.tenant)
        if len(self._tenant_retained.keys() | {waiter.tenant}) < 2 or self._tenant_retained[waiter.tenant] >= fair:
            return
        for key in list(self._idle):
            if self._fits(hold, waiter.need):
                return
            victim = self.sessions[key]
            if victim.tenant != waiter.tenant and self._tenant_retained[victim.tenant] > fair \
                    and key not in self._waiting:
                self._end_retention(key, victim)
                self.counters.evicted += 1
                self.counters.over_share += 1

    def _evict_for(self, waiter: Waiter, hold: SessionHold) -> None:
        # Idle sessions first (least recently used first); then sessions whose turn waits
        # behind this one, the newest waiter first: those ahead of it keep their place.
        waiting = list(self.queue.values())
        at = next(i for i, w in enumerate(waiting) if w.ticket == waiter.ticket)
        behind = {w.session: i for i, w in enumerate(waiting) if i > at}
        # (a lifetime its client declared keeps a session's place longest among the idle)
        candidates = [(0, bool(h.min_ttl), h.finished_at or 0.0, k) for k in self._idle
                      if k not in self._waiting for h in (self.sessions[k],)]
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
        for key in list(self._idle):
            if self._tenant_retained[tenant] <= limit:
                break
            h = self.sessions[key]
            if h.tenant == tenant:
                self._end_retention(key, h)
                self.counters.over_share += 1
