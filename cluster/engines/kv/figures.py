"""What a replica's KV budget reads out: its token totals, its autoscaling demand and its snapshot.

Read-only views over `KvBudget`'s state (`kv/budget.py` decides; `kv/accounting.py` keeps the
running totals these read). The snapshot is what `stats` and the metrics facade report per replica.
"""

from __future__ import annotations


class Figures:
    """Mixin of `KvBudget`: figures over its holds, queue and counters (no state of its own)."""

    @property
    def running_tokens(self) -> int:
        return self._running

    @property
    def retained_tokens(self) -> int:
        return self._idle_tokens

    @property
    def queued_tokens(self) -> int:
        return sum(w.need for w in self.queue.values())

    @property
    def used(self) -> int:
        return self._used

    def demand(self) -> float:
        """(running + retained + queued) / capacity: what autoscaling follows. Each tenant's
        retained prefixes count up to its fair share only, and idle ones kept for a declared
        lifetime not at all: one key's retention alone does not scale the engines up (ten `12h` prewarms held demand at 1.0 for 11 idle hours)."""
        fair = self.fair_share()
        over = sum(max(0.0, held - self._tenant_declared[tenant] - fair)
                   for tenant, held in self._tenant_retained.items())
        left_out = over + self._declared_idle_tokens
        return max(0.0, self.used + self.queued_tokens - left_out) / max(1, self.capacity)

    def session_tokens(self) -> int:
        """Tokens a session typically holds here (its footprint; what one more costs a placement)."""
        return int(self._used / self._resident) if self._resident else int(self.growth_per_turn)

    def headroom(self) -> int:
        return self.capacity - self.used - self.queued_tokens

    def snapshot(self, now: float) -> dict[str, float | int]:
        c = self.counters
        head_wait = now - next(iter(self.queue.values())).since if self.queue else 0.0
        return {"capacity_tokens": self.capacity, "running_tokens": self.running_tokens,
                "retained_tokens": self.retained_tokens, "queued_tokens": self.queued_tokens,
                "retained_sessions": len(self._idle),
                "queued_turns": len(self.queue), "head_wait_s": round(head_wait, 3),
                "admitted": c.admitted, "waited": c.queued, "queue_wait_s": round(c.queue_wait_s, 3),
                "max_queue_wait_s": round(c.max_queue_wait_s, 3), "retained": c.retained,
                "returned_in_time": c.returned_in_time, "expired": c.expired, "released": c.released,
                "evicted": c.evicted, "evicted_soft": c.evicted_soft, "evicted_lapsed": c.evicted_lapsed,
                "reprefills": c.reprefills, "over_wave": c.over_wave, "refused": c.refused, "over_share": c.over_share, "declared_over_share": c.declared_over_share,
                "prefill_tokens_per_s": round(self.prefill_tps or 0.0, 1),
                "growth_per_turn": round(self.growth_per_turn, 1),
                "growth_room_tokens": self.growth_room(), "engine_excess_tokens": self.engine_excess,
                "ended_session_tokens": round(self.shape.ended_tokens or 0), "engine_share": round(self.shape.engine_share or 0, 3),
                "turn_s": round(self.shape.turn_s or 0, 3), "waves": int(self.shape.waves(self.prefill_tps)),
                "shared_tokens": sum(max(v) for v in self._shared.values())}
