"""How the KV budget ends retention: when it expires, and early: for a waiting turn, for a
tenant over its share.

A mixin of `KvBudget` (`kv/budget.py`), split out to keep each file readable; it reads and
changes the budget's holds only through `_change`, so the running totals stay exact.
"""

from __future__ import annotations

import heapq
from typing import Any, Optional

from cluster.engines.kv.policy import RetentionEnd, SessionHold, Waiter


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
    used: int
    engine_excess: int
    _running: int
    prefill_tps: Any
    shape: Any  # kv/policy.LoopShape
    lengths: Any  # kv/policy.ChainLengths
    _now: float  # the clock of the latest call

    def ttl(self, hold: SessionHold) -> float:
        """2x its long pauses (clamped), at least its client's declared lifetime, and at least the
        time its prefix takes to compute again (or copy back from a tier below; up to `ttl_max_s`):
        an expiry frees room nobody asked for yet (a turn that needs it ends retention by the cost
        rules), and on a slow engine a pause past the learned TTL cost a re-prefill longer than it."""
        p = self.policy
        learned = p.ttl_initial_s if hold.pause_high is None else \
            min(p.ttl_max_s, max(p.ttl_min_s, p.ttl_pause_multiple * hold.pause_high))
        rate = p.lower_tier_tokens_per_s or self.prefill_tps
        return max(learned, hold.min_ttl, min(p.ttl_max_s, hold.retained / rate) if rate else 0.0)

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
        self._now = now  # every call into the budget passes here first (`return_chance` reads it)
        aside = []  # a session whose turn waits is back: it keeps its place
        while self._expiries and self._expiries[0][0] <= now:
            entry = heapq.heappop(self._expiries)
            hold = self._live_expiry(entry)
            if hold is None:
                continue
            if self._waiting[entry[2]]:
                aside.append(entry)
                continue
            self._observe_end(hold)
            self._end_retention(entry[2], hold, "expired")
            self.counters.expired += 1
        for entry in aside:
            heapq.heappush(self._expiries, entry)

    def _observe_end(self, hold: SessionHold) -> None:
        """Its retention ended unused (expired, or its socket closed): the chain's end, as far as
        this replica can tell (`ChainLengths` takes it back if the chain returns)."""
        self.shape.observe_end(hold.retained)
        self.lengths.observe_end(hold, hold.returns + 1)

    def _end_retention(self, key: str, hold: SessionHold, why: str) -> None:
        idle = self._now - hold.finished_at if hold.finished_at is not None else 0.0
        self.ends.append(RetentionEnd(why, hold.retained, hold.returns + 1, round(idle, 2),
                                      round(self.return_chance(hold), 3), self._now))
        self.unpinning[key] = hold.retained  # the engine holds them until its unpin is delivered
        self._change(hold, retained=0)
        hold.released = True
        hold.soft = False
        self.dropped.append(key)

    LAPSE_MULTIPLE = 2.0  # idle this many times a chain's longest pause: more likely ended

    def lapsed(self, hold: SessionHold) -> bool:
        """Idle more than twice the longest pause its chain ever took (two pauses seen at least,
        at least `ttl_min_s`), with no declared lifetime: an HTTP chain or a stored socket's
        chain that ended without a word. The re-prefill floor of `ttl` keeps such a chain for
        long on a slow engine; a waiting turn need not wait for that."""
        if hold.min_ttl or hold.returns < 2 or hold.pause_max is None or hold.finished_at is None:
            return False
        idle = self._now - hold.finished_at
        return idle > max(self.policy.ttl_min_s, self.LAPSE_MULTIPLE * hold.pause_max)

    def ended(self, hold: SessionHold) -> bool:
        """Lapsed, or (no declared lifetime, and no socket whose close will tell its end) as many
        turns as this replica's chains end after."""
        return self.lapsed(hold) or (not hold.min_ttl and hold.judged_by_length
                                     and self.lengths.likely_ended(hold.returns + 1))

    def _evict_idle_for(self, waiter: Waiter, hold: SessionHold, soft: bool = True) -> None:
        """Ended retentions (`ended`), and (`soft`) soft ones (a chain that may come back but
        gave no sign), give their room to a waiting turn at once, least recently used first."""
        for key in list(self._idle):
            if self._fits(hold, waiter.need):
                return
            victim = self.sessions[key]
            if key in self._waiting or key == waiter.session:
                continue
            if soft and victim.soft:
                self.counters.evicted_soft += 1
                why = "soft"
            elif self.ended(victim):
                self.counters.evicted_lapsed += 1
                why = "lapsed" if self.lapsed(victim) else "ended_length"
            else:
                continue
            self._end_retention(key, victim, why)
            self.counters.evicted += 1

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
                self._end_retention(key, victim, "over_share")
                self.counters.evicted += 1
                self.counters.over_share += 1

    def return_chance(self, hold: SessionHold) -> float:
        """The chance an idle retained session comes back while it is retained: this replica's
        record for chains of its length (`ChainLengths`; not where a socket's close tells its end), weighed
        against its record over all (retentions a session came back to, against those that
        expired, from a start of one);
        half that for a soft retention (a chain that gave no sign it will be back). Past the
        longest pause it has taken, by that pause over its idle time: a chain ends without a word
        (an HTTP client; a socket whose responses are stored), and one idle well past its pauses
        is more likely done than paused, and holds the largest history of all."""
        c = self.counters
        chance = (c.returned_in_time + 1) / (c.returned_in_time + c.expired + 1)
        if hold.judged_by_length:
            chance = self.lengths.chance(hold.returns + 1, chance)
        if hold.pause_high and hold.finished_at is not None and self._now - hold.finished_at > hold.pause_high:
            chance *= hold.pause_high / (self._now - hold.finished_at)
        return chance / 2 if hold.soft else chance

    def _victims(self, waiter: Waiter, deficit: float) -> list[str]:
        """The idle retentions that end so `waiter` gets `deficit` tokens, at the least expected
        cost: each costs its chance to come back x the tokens it would prefill again. The
        cheapest first until they cover the deficit, or the cheapest one that covers it alone,
        whichever costs less (three of 300 rather than one of 1,000; one of 400 rather than two
        of 300). The choice follows the sessions' state, not when they arrived or last ran
        (least recently used breaks ties only); declared lifetimes go last."""
        candidates = sorted(
            (bool(h.min_ttl), self.return_chance(h) * h.retained, h.finished_at or 0.0, k)
            for k in self._idle if k not in self._waiting and k != waiter.session for h in (self.sessions[k],))
        greedy: list[str] = []
        cost, left = 0.0, deficit
        for declared, c, _, key in candidates:
            if left <= 0:
                break
            greedy.append(key)
            cost += c + declared * self.capacity  # a declared lifetime ends only when nothing else will do
            left -= self.sessions[key].retained
        single = min(((c + declared * self.capacity, key) for declared, c, _, key in candidates
                      if self.sessions[key].retained >= deficit), default=None)
        if single is not None and (left > 0 or single[0] < cost):
            return [single[1]]
        return greedy

    def _deficit(self, waiter: Waiter, hold: SessionHold) -> int:
        """Tokens `waiter` lacks (what the budget holds, the engine's excess, and its own extra,
        over the capacity; room kept for others' growth not counted)."""
        return self.used + self._extra(hold, waiter.need) + self.engine_excess - self.capacity

    def _eviction_cost(self, waiter: Waiter, hold: SessionHold) -> float:
        """Tokens expected to be prefilled again (or copied back) if retention ends so `waiter`
        fits: its victims' retained tokens, each by its chance to come back; what idle sessions
        cannot free comes from sessions waiting behind it, counted in full."""
        deficit = self._deficit(waiter, hold)
        if deficit <= 0:
            return 0.0
        cost = 0.0
        for key in self._victims(waiter, deficit):
            victim = self.sessions[key]
            cost += self.return_chance(victim) * victim.retained
            deficit -= victim.retained
        return cost + max(0, deficit)

    def _wait_bound(self, waiter: Waiter, hold: SessionHold) -> float:
        """How long `waiter` may wait before it ends others' retention.

        A session without a prefix here (new, or one whose retention ended) waits for room while
        something runs, up to `max_queue_wait_s`, unless a re-prefill is measured to cost less
        than a turn (`LoopShape.waves`): ending a
        retention for it only trades places (the session that loses its prefix is back within
        its pause and waits in turn), costs a re-prefill, and adds no work to the engine's batch.
        Room frees as sessions end: whole sessions are admitted in waves, not a retention ended at
        each turn. (Several replicas: it moves where there is room after `move_after_s`.)
        Elsewhere it waits by the cost rule below, as a session back for its next turn does.

        A session back for its next turn gets no room by waiting (the others come back too), and
        an engine with nothing to run loses each second waited: they wait until their wait, paid
        by every turn queued (wait x queued turns), reaches what the retention saves: the expected
        re-prefill of its cheapest victims at the engine's measured rate."""
        bound = self.policy.max_queue_wait_s
        lower = self.policy.lower_tier_tokens_per_s
        resident = hold.retained > 0 or hold.turns > 0
        if lower is None and (self.prefill_tps is None or
                              (self.wave_under_way() is not None and not resident and self.shape.waves(self.prefill_tps))):
            return bound
        # With a tier below, an ended retention costs a copy back (no compute), not a re-prefill.
        seconds = self._eviction_cost(waiter, hold) / (lower or self.prefill_tps)
        return min(bound, seconds / max(1, len(self.queue)))

    def wave_under_way(self) -> Optional[float]:
        """Until when the sessions here are still at work (None: they are not): while turns run
        (inf); on an engine-bound replica also while the session that last finished a turn is
        within its longest pause (before it took one: this replica's mean pause). Between two turns of an engine-bound loop the engine may have
        nothing to run for a pause; a new session let in then, past the room kept for the
        residents' growth, forces one of them out as they grow (a whole re-prefill, on a CPU half a
        minute) to save the engine a second or two. Where pauses dominate, an idle engine is not
        made to wait for them."""
        if self._running:
            return float("inf")
        if not self._idle or not self.shape.engine_bound:
            return None
        last = self.sessions[next(reversed(self._idle))]
        pause = last.pause_max if last.pause_max is not None else self.shape.pause_s  # its own, or this replica's
        if last.soft or last.finished_at is None or pause is None:
            return None
        until = last.finished_at + pause
        return until if until > self._now else None

    def _evict_for(self, waiter: Waiter, hold: SessionHold) -> None:
        # Idle sessions first (cheapest first, `_victims`); then sessions whose turn waits
        # behind this one, the newest waiter first: those ahead of it keep their place.
        waiting = list(self.queue.values())
        at = next(i for i, w in enumerate(waiting) if w.ticket == waiter.ticket)
        behind = {w.session: i for i, w in enumerate(waiting) if i > at}
        deficit = self._deficit(waiter, hold)
        candidates = self._victims(waiter, deficit)
        candidates += [k for k, i in sorted(behind.items(), key=lambda kv: -kv[1]) if k != waiter.session
                       and self.sessions[k].retained and not self.sessions[k].turns]
        for key in candidates:
            if self._fits(hold, waiter.need, spare=False):
                return
            self._end_retention(key, self.sessions[key], "cost" if key not in behind else "behind")
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
                self._end_retention(key, h, "tenant_share")
                self.counters.over_share += 1
