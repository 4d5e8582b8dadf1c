"""The engine replica's KV budget: which turns run, and which sessions' prefixes stay.

Plain logic driven by calls with an explicit clock (no tasks, no timers; the engine
replica owns those). One engine replica has a fixed KV pool of `capacity` tokens. An
engine left alone evicts the least recently freed blocks, whoever they belong to, and
preempts running requests when the pool runs out; with a handful of agent sessions
that means every turn re-prefills its whole history. The budget keeps that from
happening:

- **A session is a chain** (the same key over a held WebSocket, a new one or HTTP): what it
  holds, its pauses and whether it comes back are learned from its own turns.
- **Admission.** A turn reserves its prompt plus its output budget and starts when what
  runs plus what is retained plus its reservation fits; otherwise it waits in one FIFO
  queue, bounded (`max_queued_turns`, `max_queued_per_tenant`: past them `QueueFull`, a
  429 with Retry-After). A retained session's turn needs only its growth and may pass.
- **Waves, cost-aware waiting.** A waiting turn first takes the room of *soft* retentions
  (chains that may come back but gave no sign) and of lapsed ones (idle past twice every pause
  their chain took: more likely ended than paused). A session without a prefix here waits for room
  while something runs (engine-bound: or its residents are within their pause), up to
  `max_queue_wait_s`: ending a retention for it only trades places,
  so sessions that do not fit at once run in waves of whole sessions. A session back for its
  next turn, or any turn on an engine with nothing to run, waits until its wait x the turns
  queued reaches the expected re-prefill of the cheapest retentions that free its room (their
  tokens x their chance to come back, at the measured prefill rate; `kv/eviction.py`). With a
  tier below the engine (host memory), an ended retention costs only the copy back.
- **Retention.** A session expected back (its socket is open, it called tools, it came
  back before, or its client declared a lifetime) keeps its prefix for a TTL learned from
  its own pauses, at least its declared `prompt_cache_options.ttl` (clamped) and the time its
  prefix takes to compute again (`kv/eviction.py`). A chain that can be continued but gave no
  sign is kept softly. One tenant's retained tokens are capped at `tenant_share`. Others free
  their tokens at once.
- **Tenants.** A waiting turn of a tenant under its fair share (the capacity over the tenants
  here) takes room at once from idle retention of tenants over theirs; retention beyond a
  tenant's fair share is left out of the autoscaling demand.
- **Accounting.** Re-prefills, waits, refusals, expirations and evictions are counted.

The engine itself must keep the retained sessions' blocks while others run: vLLM's
scheduler subclass in `vllm/retention.py` pins them, the scripted engine's modelled cache
(`scripted/kv_model.py`) does the same. This module only decides.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

from cluster.engines.kv.policy import (  # noqa: F401 - the budget's vocabulary, re-exported
    GROWTH_WEIGHT, KV_METRICS, PAUSE_DECAY, BudgetCounters, BudgetPolicy, ChainLengths, LoopShape, PrefillRate, QueueFull,
    RetentionEnd, SessionHold, Waiter)
from cluster.engines.kv.accounting import Totals
from cluster.engines.kv.eviction import Evictions
from cluster.engines.kv.figures import Figures


RECENT_ENDS = 64  # retention ends kept for `stats` (bounded: a replica's last few)


@dataclass
class KvBudget(Evictions, Figures, Totals):
    capacity: int
    policy: BudgetPolicy = field(default_factory=BudgetPolicy)
    sessions: "OrderedDict[str, SessionHold]" = field(default_factory=OrderedDict)
    queue: "OrderedDict[int, Waiter]" = field(default_factory=OrderedDict)
    counters: BudgetCounters = field(default_factory=BudgetCounters)
    _tickets: "itertools.count[int]" = field(default_factory=lambda: itertools.count(1))
    _admitted: dict[int, tuple[str, int]] = field(default_factory=dict)  # ticket -> (session, need)
    # Sessions whose retention ended since the last `take_dropped` (the engine unpins them).
    dropped: list[str] = field(default_factory=list)
    # Their tokens, until the engine has been told (`take_dropped` hands them out; the pin holds
    # the blocks until then): reconciling with the engine's count leaves these out.
    unpinning: dict[str, int] = field(default_factory=dict)
    ends: "deque[RetentionEnd]" = field(default_factory=lambda: deque(maxlen=RECENT_ENDS))  # the latest few, why
    growth_per_turn: float = 0.0  # tokens a returning session's turn adds (moving average)
    growth_samples: int = 0
    # Running totals of the holds (kept by `Totals._change`, kv/accounting.py).
    _used: int = 0
    _running: int = 0
    _resident: int = 0
    _tenant_retained: "Counter[str]" = field(default_factory=Counter)
    _shared: "dict[str, Counter[int]]" = field(default_factory=dict)
    engine_excess: int = 0
    _tenant_queued: "Counter[str]" = field(default_factory=Counter)  # tenant -> waiting turns
    _waiting: "Counter[str]" = field(default_factory=Counter)  # session -> its waiting turns
    _idle: "OrderedDict[str, None]" = field(default_factory=OrderedDict)  # retained between turns (Totals)
    _idle_tokens: int = 0
    _tenant_declared: "Counter[str]" = field(default_factory=Counter)
    _declared_idle_tokens: int = 0
    # (expiry, seq, session) of retentions: expiring is O(log n) a retention, not a walk. Entries
    # of sessions that came back or were evicted meanwhile are dropped when they surface.
    _expiries: list = field(default_factory=list)
    _seq: "itertools.count[int]" = field(default_factory=itertools.count)
    prefill: PrefillRate = field(default_factory=PrefillRate)  # what a re-prefill costs
    shape: LoopShape = field(default_factory=LoopShape)  # sessions as wholes (`growth_room`)
    lengths: ChainLengths = field(default_factory=ChainLengths)  # turns chains end after (`return_chance`)
    _now: float = 0.0  # the clock of the latest call (`_expire` sets it)

    # -- what the engine replica calls ---------------------------------------------------

    def request(self, session: str, need: int, now: float, *, tenant: str = "", min_ttl_s: float = 0.0,
                shared: int = 0, share_group: str = "") -> tuple[int, list[int]]:
        """A turn of `session` that needs `need` tokens: its ticket, and the tickets admitted by
        this call (its own when it starts now; others that the queue let in meanwhile). A turn
        not admitted waits until `finish`/`cancel`/`release`/`tick` return its ticket; one that
        would wait behind a full queue raises `QueueFull` (nothing else changed but expiries:
        the caller `tick`s). `min_ttl_s`: the retention its client asks for after this turn.
        `shared`: of `need`, tokens of a head its tenant's sessions share (`share_group`; counted
        once for all of them)."""
        self._expire(now)  # first: a session back after its TTL ran out is a re-prefill
        hold = self._hold(session)
        hold.tenant = tenant
        hold.min_ttl = max(0.0, min(min_ttl_s, self.policy.ttl_client_max_s))
        need = max(1, min(need, self.capacity))
        self._change(hold, shared=(share_group, max(0, min(shared, need - 1))))
        starts = not self.queue and self._fits(hold, need)
        if not starts and not (hold.retained and not hold.turns):  # a retained session is never refused
            if len(self.queue) >= self.policy.max_queued_turns:
                raise self._refuse(now, tenant_limit=False)
            if self._tenant_queued[tenant] >= self.policy.max_queued_per_tenant:
                raise self._refuse(now, tenant_limit=True)
        ticket = next(self._tickets)
        if hold.finished_at is not None and not hold.turns:
            pause = max(0.0, now - hold.finished_at)
            hold.pause_high = pause if hold.pause_high is None else max(pause, PAUSE_DECAY * hold.pause_high)
            self.lengths.observe_return(hold, hold.returns + 1)
            hold.returns += 1
            hold.last_pause = pause
            hold.pause_max = max(pause, hold.pause_max or 0.0)
            if hold.retained:
                self.counters.returned_in_time += 1
            elif hold.released:
                self.counters.reprefills += 1
            hold.released = False
        if hold.retained and not hold.turns:
            hold.soft = False  # it came back: whatever it holds is what this turn reuses
            growth = max(0, need - hold.retained)
            weight = GROWTH_WEIGHT if self.growth_samples else 1.0  # the first one as it is
            self.growth_samples += 1
            self.growth_per_turn += weight * (growth - self.growth_per_turn)
        if starts:
            self._start(ticket, session, need, now)
            return ticket, [ticket]
        self.queue[ticket] = Waiter(ticket, session, need, now, tenant)
        self._waiting[session] += 1
        self._tenant_queued[tenant] += 1
        self.counters.queued += 1
        return ticket, self._drain(now)

    def _refuse(self, now: float, tenant_limit: bool) -> QueueFull:
        self.counters.refused += 1
        head = next(iter(self.queue.values()), None)
        wait = 1.0
        if head is not None:
            wait = max(1.0, head.since + self._wait_bound(head, self._hold_no_touch(head.session)) - now)
        return QueueFull(min(wait, self.policy.max_queue_wait_s), tenant_limit)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    @property
    def prefill_tps(self) -> Optional[float]:
        return self.prefill.tokens_per_s

    def finish(self, ticket: int, held: int, expect_back: bool, now: float, *,
               continuable: bool = False, close_tells_end: bool = False) -> list[int]:
        """A turn ended; its session now holds `held` tokens of KV (prompt + output). It keeps
        them if it is expected back (`expect_back`: its socket is open or it called tools; or,
        `continuable`, it came back before or its client declared a lifetime), softly if it only
        may be (`continuable`: stored, or named). Returns the waiting tickets admitted now."""
        session, need = self._admitted.pop(ticket, (None, 0))
        if session is None:
            return self.cancel(ticket, now)
        hold = self._hold(session)
        hold.finished_at, hold.close_tells_end = now, close_tells_end
        if hold.last_pause is not None:
            self.shape.observe_turn(now - hold.started_at, hold.last_pause)
        if hold.min_ttl and self._tenant_declared[hold.tenant] - hold.declared_idle + held > \
                self.policy.declared_share * self.capacity:
            hold.min_ttl = 0.0  # past its tenant's declared share: retained (or not) as any other session
            self.counters.declared_over_share += 1
        firm = expect_back or (continuable and (hold.returns > 0 or hold.min_ttl > 0))
        if self.policy.retention and (firm or continuable) and held > 0:
            hold.soft = not firm
            if firm:
                self.shape.observe_live(held)
            self._change(hold, running=-need, turns=-1, retained=min(held, self.capacity))
            hold.expires_at = now + self.ttl(hold)
            self._schedule_expiry(hold)
            self.counters.retained += 1
            self._cap_tenant(hold.tenant)
        else:
            self._change(hold, running=-need, turns=-1, retained=0)
            self.dropped.append(session)  # (a turn's own blocks: freed by the engine when it ends, unpinned or not)
        return self._drain(now)

    def cancel(self, ticket: int, now: float) -> list[int]:
        """A turn given up before it ran (its client left, it moved): out of the queue, or, if it
        was admitted meanwhile, its reservation returned."""
        if ticket in self._admitted:
            return self.finish(ticket, 0, False, now)
        self._dequeue(ticket)
        return self._drain(now)

    def release(self, session: str, now: float) -> list[int]:
        """The session will not be back (its socket closed): its retained tokens go now."""
        self._now = now
        hold = self.sessions.get(session)
        if hold is not None and hold.retained:
            self._observe_end(hold)
            self._end_retention(session, hold, "released")
            self.counters.released += 1
        return self._drain(now)

    def tick(self, now: float) -> list[int]:
        """Time passed: expire retentions, let a queue head that waited too long in."""
        return self._drain(now)

    def take_dropped(self) -> list[str]:
        """Sessions whose retention ended since the last call (their blocks may go now)."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def next_deadline(self) -> Optional[float]:
        """When `tick` may admit someone next (a retention expiring, the queue head's wait
        bound); None when nothing waits."""
        if not self.queue:
            return None
        head = next(iter(self.queue.values()))
        head_hold = self._hold_no_touch(head.session)
        deadline = head.since + self._wait_bound(head, head_hold)
        wave = self.wave_under_way()
        if not (head_hold.retained or head_hold.turns) and wave is not None and wave < deadline:
            deadline = wave  # the residents' pause is over then: a new session's bound may change
        for w in self.queue.values():  # sessions back to their prefix may end retention behind the head
            hold = self._hold_no_touch(w.session)
            if w is not head and (hold.retained or hold.turns):
                deadline = min(deadline, w.since + self._wait_bound(w, hold))
        expiry = self._next_expiry()
        return deadline if expiry is None else min(deadline, expiry)

    def retained_sessions(self) -> dict[str, float]:  # session -> its retention's expiry (the engine keeps its blocks)
        return {k: self.sessions[k].expires_at for k in self._idle}

    # -- the rules -----------------------------------------------------------------------

    def _hold(self, session: str) -> SessionHold:
        hold = self.sessions.get(session)
        if hold is None:
            hold = self.sessions[session] = SessionHold(key=session)
            self._forget_idle()
        else:
            self.sessions.move_to_end(session)
        return hold

    def _forget_idle(self) -> None:
        # Pause statistics of long-gone sessions: the least recently used idle ones go first (the
        # walk stops as soon as enough are gone: those at the front are the oldest).
        excess = len(self.sessions) - self.policy.max_sessions
        if excess <= 0:
            return
        gone = []
        for key, h in self.sessions.items():
            if not h.turns and not h.retained and key not in self._waiting:
                gone.append(key)
                if len(gone) >= excess:
                    break
        for key in gone:
            del self.sessions[key]

    def _fits(self, hold: SessionHold, need: int, spare: bool = True) -> bool:
        if not hold.turns and not self.used:
            return True  # alone on the replica: whatever it needs, nobody else is holding it back
        room = self.capacity
        if spare and not (hold.retained or hold.turns):
            room -= self.growth_room(need)
        room -= self.engine_excess  # the engine holds it, whatever the budget counted
        return self.used + self._extra(hold, need) <= room

    def growth_room(self, need: int = 0) -> int:
        """Room a session without a prefix here leaves free when it starts: one turn's growth
        (this replica's recent average) for each session that holds a prefix. Without it, a
        session let in on room that is only there for a moment forces one of those sessions
        out at their next turn, and then itself at its next: each time a whole re-prefill.
        Where the engine is the loops' bottleneck, their growth to the size sessions here end
        at (`LoopShape`), the new session's own (`need`) too: sessions that started together would
        outgrow the pool halfway and each drop a prefix, where a second wave costs no throughput."""
        to_end = self.shape.to_end(self._resident + (need > 0), self._used + need, self.prefill_tps)
        return max(int(self.growth_per_turn * self._resident), to_end)

    def _start(self, ticket: int, session: str, need: int, now: float) -> None:
        hold = self._hold(session)
        hold.started_at = now
        self._change(hold, running=need, turns=1)  # a retained prefix stays counted: it is what this turn reuses
        self._admitted[ticket] = (session, need)
        self.counters.admitted += 1

    def _drain(self, now: float) -> list[int]:
        """Admit what fits: the head in order; behind it, turns of sessions whose prefix is
        retained here (they need only their growth). A head that waited too long ends the
        retention of idle sessions (least recently used first) until it fits. When nothing
        runs and nothing fits, every token is held by sessions between turns or waiting to
        grow: a session that is back cannot grow, the others' TTLs do not run while their
        turns wait, and the engine idles. So the first waiter whose prefix is retained ends
        other sessions' retention at once (idle ones first, then those waiting behind it)."""
        self._expire(now)
        admitted = self._admit(now)
        while self.queue and not self.running_tokens:
            target = next((w for w in self.queue.values() if self._hold_no_touch(w.session).retained), None)
            if target is None:
                break  # new sessions wait for retention to end (its TTL, or the queue's wait bound)
            self._evict_for(target, self._hold_no_touch(target.session))
            more = self._admit(now)
            if not more:
                break
            admitted += more
        return admitted

    def _admit(self, now: float) -> list[int]:
        admitted: list[int] = []
        head_blocked = urgent = False
        for ticket, w in list(self.queue.items()):
            hold = self._hold_no_touch(w.session)
            resident = hold.retained > 0 or hold.turns > 0
            if urgent or (head_blocked and not resident):
                continue  # behind a head that waited too long, nobody passes
            if not head_blocked and not self._fits(hold, w.need):
                # (a wave's newcomer would only trade places with a soft chain: lapsed ones only)
                waves = self.wave_under_way() is not None and self.shape.engine_bound and self.shape.waves(self.prefill_tps)
                self._evict_idle_for(w, hold, soft=resident or not waves)
                self._evict_over_share_for(w, hold)
            # (a session back to its prefix gets no room by waiting, behind a blocked head too)
            overdue = (not head_blocked or resident) and now - w.since >= self._wait_bound(w, hold)
            if not self._fits(hold, w.need, spare=not overdue) and overdue:
                self._evict_for(w, hold)
                urgent = not self._fits(hold, w.need, spare=False)
            if self._fits(hold, w.need, spare=not overdue):
                if overdue and not resident and not self._fits(hold, w.need):
                    self.counters.over_wave += 1
                self._dequeue(ticket)
                wait = now - w.since
                self.counters.queue_wait_s += wait
                self.counters.max_queue_wait_s = max(self.counters.max_queue_wait_s, wait)
                self._start(ticket, w.session, w.need, now)
                admitted.append(ticket)
            elif not head_blocked:
                head_blocked = True
        return admitted

    def _dequeue(self, ticket: int) -> None:
        w = self.queue.pop(ticket, None)
        if w is not None:
            self._waiting[w.session] -= 1
            if not self._waiting[w.session]:
                del self._waiting[w.session]
            self._tenant_queued[w.tenant] -= 1
            if not self._tenant_queued[w.tenant]:
                del self._tenant_queued[w.tenant]

    def _hold_no_touch(self, session: str) -> SessionHold:
        hold = self.sessions.get(session)
        if hold is None:
            hold = self.sessions[session] = SessionHold(key=session)
        return hold
