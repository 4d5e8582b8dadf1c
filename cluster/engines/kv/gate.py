"""The engine replica's KV budget on its event loop: waiting turns as futures, one timer.

The rules are `cluster.engines.kv.budget.KvBudget` (plain logic); this adapter owns what
waits: a future per queued turn, the timer for the next retention expiry or queue-wait
bound, and the set of sessions whose pins the engine should drop with its next request.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from typing import Callable, Optional

from cluster.engines.kv.accounting import OutputReserve, SharedHeads
from cluster.engines.kv.budget import BudgetPolicy, KvBudget, QueueFull


def pin_key(cache_salt: Optional[str], session_key: str) -> str:
    """A session's name in the budget and in the engine's pins (a digest: bounded size)."""
    return hashlib.sha256(f"{cache_salt or ''}\x00{session_key}".encode()).hexdigest()[:24]


class KvGate:
    def __init__(self, capacity: int, policy: BudgetPolicy, clock: Callable[[], float] = time.monotonic,
                 block_size: int = 1) -> None:
        # Counted in whole blocks, as the engine allocates them (a session's last block is partial).
        self.block = max(1, block_size)
        self.budget = KvBudget(capacity // self.block * self.block, policy)
        self.clock = clock
        self._waiting: dict[int, asyncio.Future] = {}
        self._timer: Optional[asyncio.TimerHandle] = None
        self._unpins: set[str] = set()
        self.outputs = OutputReserve()
        self.heads = SharedHeads(self.block)

    def request(self, session: str, prompt: array, max_tokens: int, *, image_tokens: int = 0, tenant: str = "",
                min_ttl_s: float = 0.0, engine_in_use: Optional[int] = None) -> tuple[int, Optional[asyncio.Future]]:
        """A turn's ticket, and a future to await when it has to wait (None: start now). It reserves
        its prompt and the output its session's turns produced lately (kv/accounting.py), its
        tenant's shared head counted once; `engine_in_use`: the engine's own count, reconciled
        first. Raises `QueueFull` when it would wait behind a full queue."""
        if engine_in_use is not None:  # less what it still holds only until the unpins pending reach it
            self.budget.reconcile(engine_in_use - sum(self.budget.unpinning.get(k, 0) for k in self._unpins))
        need = len(prompt) + image_tokens + self.outputs.reserve(session, max_tokens, self.block)
        group, shared = self.heads.shared(tenant, prompt)
        try:
            ticket, admitted = self.budget.request(session, self._blocks(need), self.clock(), tenant=tenant,
                                                   min_ttl_s=min_ttl_s, shared=shared, share_group=group)
        except QueueFull:
            self._changed(self.budget.tick(self.clock()))  # what expired on the way in
            raise
        self._unpins.discard(session)  # it is back: its blocks are what this turn reuses
        self.budget.unpinning.pop(session, None)
        fut = None
        if ticket not in admitted:
            fut = self._waiting[ticket] = asyncio.get_running_loop().create_future()
        self._changed([t for t in admitted if t != ticket])  # others the queue let in meanwhile
        return ticket, fut

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block) * self.block

    def position(self, ticket: int) -> int:
        for i, t in enumerate(self.budget.queue):
            if t == ticket:
                return i + 1
        return 0

    def pin_ttl(self, session: str) -> float:
        """How long the engine may keep this session's blocks after its turn on its own (0: retention
        off). The budget ends a pin itself (unpins ride on the next request); the engine's own expiry
        is the backstop, so it is the budget's TTL plus the longest a returning turn may wait
        (a session whose turn waits keeps its retention)."""
        policy = self.budget.policy
        if not policy.retention:
            return 0.0
        hold = self.budget.sessions.get(session)
        ttl = self.budget.ttl(hold) if hold is not None else policy.ttl_initial_s
        return ttl + policy.max_queue_wait_s

    def take_unpins(self) -> tuple[str, ...]:
        unpins, self._unpins = tuple(self._unpins), set()
        for key in unpins:
            self.budget.unpinning.pop(key, None)
        return unpins

    def finish(self, ticket: int, held: int, expect_back: bool, continuable: bool = False,
               output_tokens: Optional[int] = None, close_tells_end: bool = False) -> None:
        """The turn ended holding `held` tokens; `output_tokens` it produced (None: it did not end
        on its own, nothing learned); `close_tells_end`: its WebSocket's close will release
        the session (nothing of it stored)."""
        self._waiting.pop(ticket, None)
        session = self.budget._admitted.get(ticket, (None, 0))[0]
        if output_tokens is not None and session is not None:
            self.outputs.observe(session, output_tokens)
        self._changed(self.budget.finish(ticket, self._blocks(held), expect_back, self.clock(),
                                         continuable=continuable, close_tells_end=close_tells_end))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.budget.observe_prefill(tokens, seconds)

    def cancel(self, ticket: int) -> None:
        self._waiting.pop(ticket, None)
        self._changed(self.budget.cancel(ticket, self.clock()))

    def release(self, session: str) -> None:
        self._changed(self.budget.release(session, self.clock()))

    def holds(self, session: str) -> bool:
        """Does `session` hold a prefix here (retained, or a turn running)?"""
        hold = self.budget.sessions.get(session)
        return hold is not None and bool(hold.retained or hold.turns)

    def retaining(self) -> bool:
        """Is any session's retention still running?"""
        now = self.clock()
        return any(expiry > now for expiry in self.budget.retained_sessions().values())

    def snapshot(self) -> dict[str, float | int]:
        return self.budget.snapshot(self.clock())

    def _changed(self, admitted: list[int]) -> None:
        for ticket in admitted:
            fut = self._waiting.pop(ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._unpins.update(self.budget.take_dropped())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.budget.next_deadline()
        if deadline is not None:
            delay = max(0.0, deadline - self.clock()) + 0.001
            self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._changed(self.budget.tick(self.clock()))
