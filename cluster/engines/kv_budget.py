"""The engine replica's KV budget: which turns run, and which sessions' prefixes stay.

Plain logic driven by calls with an explicit clock (no tasks, no timers; the engine
replica owns those). One engine replica has a fixed KV pool of `capacity` tokens. An
engine left alone evicts the least recently freed blocks, whoever they belong to, and
preempts running requests when the pool runs out; with a handful of agent sessions
that means every turn re-prefills its whole history. The budget keeps that from
happening:

- **Admission.** A turn reserves its prompt plus its output budget. It starts when
  what runs plus what is retained plus its reservation fits the capacity; otherwise it
  waits in one FIFO queue. A turn of a session whose prefix is retained here only needs
  its growth and may pass the queue (holding it back would keep its tokens pinned for
  longer). The head of the queue that has waited `max_queue_wait_s` may end other
  sessions' retention to fit: no turn waits without bound.
- **Retention.** A session that finished a turn and is expected back keeps its tokens
  (prompt + output: its prefix) for a TTL learned from its own pauses (a multiple of
  its longest recent pause, clamped). A session not expected back, a released one (its
  socket closed) and an expired one free their tokens at once.
- **Accounting.** Every re-prefill of a session whose retention ended is counted, as
  are the queue waits, expirations and retentions ended early.

The engine itself must keep the retained sessions' blocks while others run: vLLM's
scheduler subclass in `vllm_retention.py` pins them, the scripted engine's modelled
cache (`kv_model.py`) does the same. This module only decides.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from cluster.config import KvBudgetConfig


# The engine replica's KV figures as OpenTelemetry gauges (attribute `replica`), each read
# from `snapshot()` (plus the engine's own counters): name -> (snapshot key, description).
KV_METRICS = {
    "loopserve.engine.kv.capacity": ("capacity_tokens", "KV capacity of the engine replica (tokens)"),
    "loopserve.engine.kv.running": ("running_tokens", "tokens reserved by turns running on the replica"),
    "loopserve.engine.kv.retained": ("retained_tokens", "tokens of sessions kept through their pauses"),
    "loopserve.engine.kv.queued": ("queued_tokens", "tokens of turns waiting for room in the KV budget"),
    "loopserve.engine.kv.queued_turns": ("queued_turns", "turns waiting for room in the KV budget"),
    "loopserve.engine.kv.head_wait": ("head_wait_s", "seconds the oldest waiting turn has waited"),
    "loopserve.engine.kv.max_queue_wait": ("max_queue_wait_s", "longest wait of an admitted turn (seconds)"),
    "loopserve.engine.kv.hit_ratio": ("hit_ratio", "cached / prompt tokens of the replica's requests"),
    "loopserve.engine.kv.preemptions": ("preemptions", "requests the engine preempted (total)"),
    "loopserve.engine.kv.migrations": ("migrations", "sessions moved off the replica for lack of room (total)"),
    "loopserve.engine.kv.reprefills": ("reprefills", "turns of sessions whose retention had ended (total)"),
}


PAUSE_DECAY = 0.8
GROWTH_WEIGHT = 0.2  # of the latest turn in the moving average of growth per turn


@dataclass(frozen=True)
class BudgetPolicy:
    """The knobs (from `engine.kv_budget` in the config)."""

    retention: bool = True
    ttl_initial_s: float = 10.0  # a session's first pause, before any was seen
    ttl_min_s: float = 2.0
    ttl_max_s: float = 60.0
    ttl_pause_multiple: float = 2.0  # TTL = this x the session's long pauses (decayed maximum)
    max_queue_wait_s: float = 60.0  # then the head of the queue may end other sessions' retention
    max_sessions: int = 100_000  # sessions tracked for their pause statistics (LRU)

    @classmethod
    def of(cls, config: "KvBudgetConfig") -> "BudgetPolicy":
        return cls(retention=config.retention, ttl_initial_s=config.ttl_initial_s, ttl_min_s=config.ttl_min_s,
                   ttl_max_s=config.ttl_max_s, ttl_pause_multiple=config.ttl_pause_multiple,
                   max_queue_wait_s=config.max_queue_wait_s)


@dataclass
class SessionHold:
    """What one session holds on this replica."""

    running: int = 0  # tokens reserved by its turns in flight
    turns: int = 0  # its turns in flight
    retained: int = 0  # tokens of its prefix kept for its next turn
    expires_at: float = 0.0
    finished_at: Optional[float] = None  # when its last turn ended (its pause starts)
    # Its long pauses: the longest one, decaying by PAUSE_DECAY a pause (a TTL must cover the
    # pauses a session actually takes, not their mean: half of them are longer than that).
    pause_high: Optional[float] = None
    released: bool = False  # its retention ended before it came back (expired, released, evicted)

    @property
    def footprint(self) -> int:
        return max(self.running, self.retained)


@dataclass
class Waiter:
    ticket: int
    session: str
    need: int
    since: float


@dataclass
class BudgetCounters:
    admitted: int = 0
    queued: int = 0  # turns that had to wait
    queue_wait_s: float = 0.0
    max_queue_wait_s: float = 0.0
    retained: int = 0  # turns whose session was then retained
    returned_in_time: int = 0  # turns of a session that was still retained
    expired: int = 0
    released: int = 0
    evicted: int = 0  # retentions ended early so a queue head that waited too long could run
    reprefills: int = 0  # turns of a session whose retention had ended (its prefix may be gone)


@dataclass
class KvBudget:
    capacity: int
    policy: BudgetPolicy = field(default_factory=BudgetPolicy)
    sessions: "OrderedDict[str, SessionHold]" = field(default_factory=OrderedDict)
    queue: "OrderedDict[int, Waiter]" = field(default_factory=OrderedDict)
    counters: BudgetCounters = field(default_factory=BudgetCounters)
    _tickets: "itertools.count[int]" = field(default_factory=lambda: itertools.count(1))
    _admitted: dict[int, tuple[str, int]] = field(default_factory=dict)  # ticket -> (session, need)
    # Sessions whose retention ended since the last `take_dropped` (the engine unpins them).
    dropped: list[str] = field(default_factory=list)
    growth_per_turn: float = 0.0  # tokens a returning session's turn adds (moving average)
    growth_samples: int = 0
    # Running totals of the holds (kept by `_change`): every admission decision reads them, so
    # they are O(1), not a walk over the replica's sessions.
    _used: int = 0  # sum of footprints
    _running: int = 0  # sum of running reservations
    _resident: int = 0  # sessions holding a prefix or running a turn

    # -- what the engine replica calls ---------------------------------------------------

    def request(self, session: str, need: int, now: float) -> tuple[int, list[int]]:
        """A turn of `session` that needs `need` tokens: its ticket, and the tickets admitted by
        this call (its own when it starts now; others that the queue let in meanwhile). A turn
        not admitted waits until `finish`/`cancel`/`release`/`tick` return its ticket."""
        ticket = next(self._tickets)
        self._expire(now)  # first: a session back after its TTL ran out is a re-prefill
        hold = self._hold(session)
        if hold.finished_at is not None and not hold.turns:
            pause = max(0.0, now - hold.finished_at)
            hold.pause_high = pause if hold.pause_high is None else max(pause, PAUSE_DECAY * hold.pause_high)
            if hold.retained:
                self.counters.returned_in_time += 1
            elif hold.released:
                self.counters.reprefills += 1
            hold.released = False
        need = max(1, min(need, self.capacity))
        if hold.retained and not hold.turns:
            growth = max(0, need - hold.retained)
            weight = GROWTH_WEIGHT if self.growth_samples else 1.0  # the first one as it is
            self.growth_samples += 1
            self.growth_per_turn += weight * (growth - self.growth_per_turn)
        if not self.queue and self._fits(hold, need):
            self._start(ticket, session, need)
            return ticket, [ticket]
        self.queue[ticket] = Waiter(ticket, session, need, now)
        self.counters.queued += 1
        return ticket, self._drain(now)

    def finish(self, ticket: int, held: int, expect_back: bool, now: float) -> list[int]:
        """A turn ended; its session now holds `held` tokens of KV (prompt + output) and
        keeps them if it is expected back. Returns the waiting tickets admitted now."""
        session, need = self._admitted.pop(ticket, (None, 0))
        if session is None:
            return self.cancel(ticket, now)
        hold = self._hold(session)
        hold.finished_at = now
        if self.policy.retention and expect_back and held > 0:
            self._change(hold, running=-need, turns=-1, retained=min(held, self.capacity))
            hold.expires_at = now + self.ttl(hold)
            self.counters.retained += 1
        else:
            self._change(hold, running=-need, turns=-1, retained=0)
            self.dropped.append(session)
        return self._drain(now)

    def cancel(self, ticket: int, now: float) -> list[int]:
        """A turn given up before it ran (its client left, it moved): out of the queue, or, if it
        was admitted meanwhile, its reservation returned."""
        if ticket in self._admitted:
            return self.finish(ticket, 0, False, now)
        self.queue.pop(ticket, None)
        return self._drain(now)

    def release(self, session: str, now: float) -> list[int]:
        """The session will not be back (its socket closed): its retained tokens go now."""
        hold = self.sessions.get(session)
        if hold is not None and hold.retained:
            self._change(hold, retained=0)
            hold.released = True
            self.counters.released += 1
            self.dropped.append(session)
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
        times = [head.since + self.policy.max_queue_wait_s]
        back = {w.session for w in self.queue.values()}
        times += [h.expires_at for k, h in self.sessions.items() if h.retained and not h.turns and k not in back]
        return min(times)

    def retained_sessions(self) -> dict[str, float]:
        """Session -> retention expiry (the engine keeps these sessions' blocks)."""
        return {k: h.expires_at for k, h in self.sessions.items() if h.retained and not h.turns}

    # -- figures -----------------------------------------------------------------------

    @property
    def running_tokens(self) -> int:
        return self._running

    @property
    def retained_tokens(self) -> int:
        return sum(h.retained for h in self.sessions.values() if not h.turns)

    @property
    def queued_tokens(self) -> int:
        return sum(w.need for w in self.queue.values())

    @property
    def used(self) -> int:
        return self._used

    def demand(self) -> float:
        """(running + retained + queued) / capacity: what autoscaling follows."""
        return (self.used + self.queued_tokens) / max(1, self.capacity)

    def headroom(self) -> int:
        return self.capacity - self.used - self.queued_tokens

    def ttl(self, hold: SessionHold) -> float:
        p = self.policy
        if hold.pause_high is None:
            return p.ttl_initial_s
        return min(p.ttl_max_s, max(p.ttl_min_s, p.ttl_pause_multiple * hold.pause_high))

    def snapshot(self, now: float) -> dict[str, float | int]:
        c = self.counters
        head_wait = now - next(iter(self.queue.values())).since if self.queue else 0.0
        return {"capacity_tokens": self.capacity, "running_tokens": self.running_tokens,
                "retained_tokens": self.retained_tokens, "queued_tokens": self.queued_tokens,
                "retained_sessions": sum(1 for h in self.sessions.values() if h.retained and not h.turns),
                "queued_turns": len(self.queue), "head_wait_s": round(head_wait, 3),
                "admitted": c.admitted, "waited": c.queued, "queue_wait_s": round(c.queue_wait_s, 3),
                "max_queue_wait_s": round(c.max_queue_wait_s, 3), "retained": c.retained,
                "returned_in_time": c.returned_in_time, "expired": c.expired, "released": c.released,
                "evicted": c.evicted, "reprefills": c.reprefills, "growth_per_turn": round(self.growth_per_turn, 1),
                "growth_room_tokens": self.growth_room()}

    # -- the rules -----------------------------------------------------------------------

    def _hold(self, session: str) -> SessionHold:
        hold = self.sessions.get(session)
        if hold is None:
            hold = self.sessions[session] = SessionHold()
            self._forget_idle()
        else:
            self.sessions.move_to_end(session)
        return hold

    def _forget_idle(self) -> None:
        # Pause statistics of long-gone sessions: the oldest idle ones go first.
        excess = len(self.sessions) - self.policy.max_sessions
        if excess <= 0:
            return
        for key in [k for k, h in self.sessions.items() if not h.turns and not h.retained][:excess]:
            del self.sessions[key]

    def _extra(self, hold: SessionHold, need: int) -> int:
        """Tokens a turn adds to the budget: a retained session's turn only its growth."""
        return max(hold.running + need, hold.retained) - hold.footprint

    def _fits(self, hold: SessionHold, need: int, spare: bool = True) -> bool:
        if not hold.turns and not self.used:
            return True  # alone on the replica: whatever it needs, nobody else is holding it back
        room = self.capacity
        if spare and not (hold.retained or hold.turns):
            room -= self.growth_room()
        return self.used + self._extra(hold, need) <= room

    def growth_room(self) -> int:
        """Room a session without a prefix here leaves free when it starts: one turn's growth
        (this replica's recent average) for each session that holds a prefix. Without it, a
        session let in on room that is only there for a moment forces one of those sessions
        out at their next turn, and then itself at its next: each time a whole re-prefill."""
        return int(self.growth_per_turn * self._resident)

    def _change(self, hold: SessionHold, *, running: int = 0, turns: int = 0,
                retained: Optional[int] = None) -> None:
        """Every change to a hold's running, turns or retained goes through here (the totals)."""
        footprint, resident = hold.footprint, bool(hold.retained or hold.turns)
        hold.running += running
        hold.turns += turns
        if retained is not None:
            hold.retained = retained
        self._used += hold.footprint - footprint
        self._running += running
        self._resident += bool(hold.retained or hold.turns) - resident

    def _start(self, ticket: int, session: str, need: int) -> None:
        hold = self._hold(session)
        self._change(hold, running=need, turns=1)  # a retained prefix stays counted: it is what this turn reuses
        self._admitted[ticket] = (session, need)
        self.counters.admitted += 1

    def _expire(self, now: float) -> None:
        back = {w.session for w in self.queue.values()}  # a session whose turn waits is back: it keeps its place
        for key, hold in self.sessions.items():
            if hold.retained and not hold.turns and hold.expires_at <= now and key not in back:
                self._change(hold, retained=0)
                hold.released = True
                self.counters.expired += 1
                self.dropped.append(key)

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
            overdue = not head_blocked and now - w.since >= self.policy.max_queue_wait_s
            if not self._fits(hold, w.need, spare=not overdue) and overdue:
                self._evict_for(w, hold)
                urgent = not self._fits(hold, w.need, spare=False)
            if self._fits(hold, w.need, spare=not overdue):
                del self.queue[ticket]
                wait = now - w.since
                self.counters.queue_wait_s += wait
                self.counters.max_queue_wait_s = max(self.counters.max_queue_wait_s, wait)
                self._start(ticket, w.session, w.need)
                admitted.append(ticket)
            elif not head_blocked:
                head_blocked = True
        return admitted

    def _hold_no_touch(self, session: str) -> SessionHold:
        hold = self.sessions.get(session)
        if hold is None:
            hold = self.sessions[session] = SessionHold()
        return hold

    def _evict_for(self, waiter: Waiter, hold: SessionHold) -> None:
        # Idle sessions first (least recently used first); then sessions whose turn waits
        # behind this one, the newest waiter first: those ahead of it keep their place.
        waiting = list(self.queue.values())
        at = next(i for i, w in enumerate(waiting) if w.ticket == waiter.ticket)
        behind = {w.session: i for i, w in enumerate(waiting) if i > at}
        queued = {w.session for w in waiting}
        candidates = [(0, h.finished_at or 0.0, k) for k, h in self.sessions.items()
                      if h.retained and not h.turns and k not in queued]
        candidates += [(1, -i, k) for k, i in behind.items() if k != waiter.session and self.sessions[k].retained
                       and not self.sessions[k].turns]
        for _, _, key in sorted(candidates):
            if self._fits(hold, waiter.need, spare=False):
                return
            victim = self.sessions[key]
            self._change(victim, retained=0)
            victim.released = True
            self.counters.evicted += 1
            self.dropped.append(key)
