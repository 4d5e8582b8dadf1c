"""The KV budget's vocabulary: its knobs, what one session holds, its counters and metrics.

Split from `kv/budget.py` (the rules) so each stays readable; both are plain logic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
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
    "loopserve.engine.kv.refused": ("refused", "turns refused with a 429: the replica's queue was full (total)"),
    "loopserve.engine.kv.prefill_rate": ("prefill_tokens_per_s", "the engine's measured prefill rate (tokens/s)"),
    "loopserve.engine.kv.pins_enabled": ("pins_enabled", "1 when the engine keeps retained sessions' blocks"),
    "loopserve.engine.kv.drift": ("drift_tokens", "the budget's tokens minus the engine's own KV usage"),
    "loopserve.engine.kv.shared": ("shared_tokens", "tokens of heads sessions share, counted once by the budget"),
    "loopserve.engine.kv.engine_excess": ("engine_excess_tokens", "KV the engine holds beyond the budget's count"),
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
    ttl_client_max_s: float = 1800.0  # the longest `prompt_cache_options.ttl` honoured
    # Of the capacity, what one tenant's sessions may keep idle under a declared lifetime: with
    # `ttl_client_max_s` the bound on the token-seconds a key pins by declaring.
    declared_share: float = 0.25
    max_queue_wait_s: float = 60.0  # then the head of the queue may end other sessions' retention
    max_sessions: int = 100_000  # sessions tracked for their pause statistics (LRU)
    max_queued_turns: int = 1024  # turns waiting on one replica; past it a 429 (Retry-After)
    max_queued_per_tenant: int = 256
    tenant_share: float = 1.0  # of the capacity one tenant's retained prefixes may hold
    # A tier below the engine's KV (host memory): an ended retention's prefix is copied back at
    # this rate (tokens/s) instead of computed again. None: no tier, an ended retention re-prefills.
    lower_tier_tokens_per_s: Optional[float] = None

    @classmethod
    def of(cls, config: "KvBudgetConfig", lower_tier_tokens_per_s: Optional[float] = None) -> "BudgetPolicy":
        return cls(retention=config.retention, ttl_initial_s=config.ttl_initial_s, ttl_min_s=config.ttl_min_s,
                   ttl_max_s=config.ttl_max_s, ttl_pause_multiple=config.ttl_pause_multiple,
                   ttl_client_max_s=config.ttl_client_max_s, max_queue_wait_s=config.max_queue_wait_s,
                   max_queued_turns=config.max_queued_turns, max_queued_per_tenant=config.max_queued_per_tenant,
                   tenant_share=config.tenant_share, declared_share=config.declared_share,
                   lower_tier_tokens_per_s=config.lower_tier_tokens_per_s or lower_tier_tokens_per_s)


@dataclass
class SessionHold:
    """What one session (a chain, whatever carries its turns) holds on this replica."""

    running: int = 0  # tokens reserved by its turns in flight
    turns: int = 0  # its turns in flight
    retained: int = 0  # tokens of its prefix kept for its next turn
    expires_at: float = 0.0
    finished_at: Optional[float] = None  # when its last turn ended (its pause starts)
    # Its long pauses: the longest one, decaying by PAUSE_DECAY a pause (a TTL must cover the
    # pauses a session actually takes, not their mean: half of them are longer than that).
    pause_high: Optional[float] = None
    # Its longest pause, undecayed: a chain idle well past every pause it ever took has more
    # likely ended than paused (`Evictions.lapsed`), where the decayed one would call a 3 s
    # pause after a run of short ones an end.
    pause_max: Optional[float] = None
    released: bool = False  # its retention ended before it came back (expired, released, evicted)
    tenant: str = ""
    returns: int = 0  # turns after its first: a chain that came back is expected back again
    min_ttl: float = 0.0  # the lifetime its client asked for (`prompt_cache_options.ttl`), clamped
    # Retained on the chance it returns (continuable, but no sign yet: no open socket, no tool
    # calls, never came back, no declared lifetime): its room goes to the first turn that needs it.
    soft: bool = False
    declared_idle: int = 0  # its tokens counted as idle under a declared lifetime (Totals._change)
    started_at: float = 0.0  # when its latest turn was admitted
    ended_after: Optional[int] = None  # its turns when its end was counted (`ChainLengths`), until it is back
    # Its latest turn came over a WebSocket whose close releases the session (nothing stored): the
    # close tells its end (an open socket is a session in its pause, whatever its length). Not a
    # stored turn's socket: a stored response may be continued from anywhere, so that close says
    # nothing (a client reconnecting each turn), and its length tells its end as an HTTP chain's.
    close_tells_end: bool = False
    last_pause: Optional[float] = None  # the client's pause before its latest turn

    key: str = ""  # the session's key in the budget
    shared: int = 0  # of its tokens, a head its tenant's sessions share (counted once for all of them)
    share_group: str = ""  # which head (kv_accounting.SharedHeads)

    @property
    def footprint(self) -> int:
        """What it holds beyond its tenant's shared head."""
        return max(0, max(self.running, self.retained) - self.shared) if self.running or self.retained else 0

    @property
    def own_retained(self) -> int:
        """Its retained tokens beyond its tenant's shared head (held once for all its sessions)."""
        return max(0, self.retained - self.shared)

    @property
    def idle_retained(self) -> bool:
        return bool(self.retained and not self.turns)

    @property
    def judged_by_length(self) -> bool:
        """Whether its length (`ChainLengths`) tells its end: not where a socket's close will."""
        return not self.close_tells_end


@dataclass
class Waiter:
    ticket: int
    session: str
    need: int
    since: float
    tenant: str = ""


@dataclass(frozen=True)
class RetentionEnd:
    """Why a retained prefix went (`expired`, `released`, `soft`, `lapsed`, `ended_length`, `cost`,
    `behind`, `over_share`, `tenant_share`), its tokens, the chain's turns, how long it had been
    idle and its chance to come back then: the replica's last few, in `stats`, so a miss a client
    saw can be told from the policy's own choice."""
    why: str
    tokens: int
    turns: int
    idle_s: float
    chance: float
    at: float


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
    evicted: int = 0  # retentions ended early so a waiting turn could run
    evicted_soft: int = 0  # of those, retentions held only on the chance the chain returns
    evicted_lapsed: int = 0  # of those, ended ones: idle far past every pause, or at the length chains end
    reprefills: int = 0  # turns of a session whose retention had ended (its prefix may be gone)
    # new sessions let in past the room kept for resident sessions' growth (`growth_room`): the engine
    # had nothing to run, or they waited their bound; each may force a resident session out later
    over_wave: int = 0
    refused: int = 0  # turns refused: the queue (or the tenant's share of it) was full
    over_share: int = 0  # retentions ended because their tenant held more than its share
    declared_over_share: int = 0  # declared lifetimes not honoured: their tenant held its declared share


class PrefillRate:
    """The engine's prefill rate (tokens/s): a moving average of what it measured. None until then."""

    WEIGHT = 0.2  # of the latest prefill
    MIN_SAMPLE = 64  # tokens: shorter prefills measure the engine's fixed cost, not its rate

    def __init__(self) -> None:
        self.tokens_per_s: Optional[float] = None

    def observe(self, tokens: int, seconds: float) -> None:
        """The engine prefilled `tokens` uncached tokens in `seconds` (its own clock)."""
        if tokens < self.MIN_SAMPLE or seconds <= 0:
            return
        rate = tokens / seconds
        prev = self.tokens_per_s
        self.tokens_per_s = rate if prev is None else prev + self.WEIGHT * (rate - prev)


class LoopShape:
    """This replica's sessions as wholes: the tokens a session holds when it ends (its socket
    closed, or its retention expired unused), the share of a session's loop spent in the engine
    (a turn's time against it plus the client's pause before it) and a turn's time. None until seen.

    The end size is a high estimate, not a mean: a wave sized by the mean outgrows the pool
    whenever its sessions end above it, and an expiry mid-session (a pause past its TTL, not an
    end) pulls a mean down. It rises to a larger end at once and falls a tenth of the way to a
    smaller one. The engine share and the turn time are moving averages."""

    WEIGHT = 0.2  # of the latest turn in the engine share and the turn time
    END_FALL = 0.1  # of the way down to a smaller end
    # Turns that take longer than the pauses between them: the loop waits on the engine, and one
    # more session running adds no throughput, only a prefix the pool must later drop.
    ENGINE_BOUND = 0.5

    def __init__(self) -> None:
        self.ended_tokens: Optional[float] = None
        self.engine_share: Optional[float] = None
        self.turn_s: Optional[float] = None

    def observe_end(self, tokens: int) -> None:
        prev = self.ended_tokens
        self.ended_tokens = float(tokens) if prev is None or tokens >= prev else prev + self.END_FALL * (tokens - prev)

    def observe_live(self, tokens: int) -> None:
        """A session expected back holds `tokens`: it will end at no less. Before any session here
        ended (or after only a warm-up's small ones), the only sign of the end size: sessions
        started together grow past the pool unseen, and each live session forced out for another's
        growth came back on room that was there for a moment and was forced out again."""
        if self.ended_tokens is None or tokens > self.ended_tokens:
            self.ended_tokens = float(tokens)

    def observe_turn(self, turn_s: float, pause_s: float) -> None:
        if turn_s + pause_s > 0:
            share = turn_s / (turn_s + pause_s)
            prev = self.engine_share
            self.engine_share = share if prev is None else prev + self.WEIGHT * (share - prev)
            self.turn_s = turn_s if self.turn_s is None else self.turn_s + self.WEIGHT * (turn_s - self.turn_s)

    @property
    def pause_s(self) -> Optional[float]:
        """A client's mean pause between turns here (from the turn time and the engine's share)."""
        if not self.turn_s or not self.engine_share:
            return None
        return self.turn_s * (1 - self.engine_share) / self.engine_share

    @property
    def engine_bound(self) -> bool:
        return self.engine_share is not None and self.engine_share >= self.ENGINE_BOUND

    def waves(self, prefill_tps: Optional[float]) -> bool:
        """Whether holding a new session back for room (a wave) can pay: unless a session's
        history, at the size sessions end at, is measured to compute again faster than one of its
        turns takes (a CPU: 4,600 tokens at ~150 tokens/s against 9 s turns: waves). On a fast
        engine a re-prefill costs less than a turn, and holding 128 sessions to waves of a dozen
        cost 1.4x the time of no policy at all (docs/benchmarks.md): there a new session waits by
        the cost rules, as a session back for its next turn does."""
        if not prefill_tps or self.ended_tokens is None or self.turn_s is None:
            return True
        return self.ended_tokens / prefill_tps >= self.turn_s

    def to_end(self, resident: int, used: int, prefill_tps: Optional[float]) -> int:
        """Tokens the `resident` sessions (holding `used`) are expected to grow by before they
        end, where the engine is the loops' bottleneck and waves pay; 0 where not, or nothing ended yet."""
        if self.ended_tokens is None or not (self.engine_bound and self.waves(prefill_tps)):
            return 0
        return max(0, int(self.ended_tokens * resident) - used)


class ChainLengths:
    """How many turns this replica's chains run: of the chains that had k turns, how many came
    back for another and how many ended (socket closed, retention expired unused). A chain whose
    retention expired and that comes back after all was not an end: it moves back.

    An HTTP chain, or a stored one over WebSockets, ends without a word: without this, its
    history, the largest of all, stays retained for its TTL and live sessions are evicted in its
    place, where a `store: false` socket's close frees it at once. Chains that end at a typical
    length let the budget tell an ended chain from a paused one by its turns (a chain whose
    socket's close will tell its end is not judged so: `SessionHold.close_tells_end`).
    Lengths past `EXACT` share a bucket per doubling, so what it holds stays bounded."""

    EXACT = 32
    LIKELY_ENDED = 2  # ended chains at a length, against each that went on, to call one there ended

    def __init__(self) -> None:
        self.went_on: Counter[int] = Counter()
        self.ended: Counter[int] = Counter()

    @classmethod
    def bucket(cls, turns: int) -> int:
        return turns if turns <= cls.EXACT else cls.EXACT + (turns // cls.EXACT).bit_length()

    def observe_return(self, hold: SessionHold, turns: int) -> None:
        """The chain came back after `turns` turns."""
        if hold.ended_after is not None:
            self.ended[self.bucket(hold.ended_after)] -= 1
            hold.ended_after = None
        self.went_on[self.bucket(turns)] += 1

    def observe_end(self, hold: SessionHold, turns: int) -> None:
        if hold.ended_after is None and turns > 0:
            hold.ended_after = turns
            self.ended[self.bucket(turns)] += 1

    def chance(self, turns: int, prior: float) -> float:
        """The chance a chain that had `turns` turns comes back: this length's record, with one
        chain's weight of `prior` (the replica's record over all lengths)."""
        k = self.bucket(turns)
        return (self.went_on[k] + prior) / (self.went_on[k] + self.ended[k] + 1)

    def likely_ended(self, turns: int) -> bool:
        k = self.bucket(turns)
        return self.ended[k] >= self.LIKELY_ENDED and self.ended[k] > self.LIKELY_ENDED * self.went_on[k]


class QueueFull(Exception):
    """The replica's queue (or the tenant's part of it) is full: a 429 with Retry-After."""

    def __init__(self, retry_after_s: float, tenant_limit: bool) -> None:
        super().__init__("queue full")
        self.retry_after_s = retry_after_s
        self.tenant_limit = tenant_limit
