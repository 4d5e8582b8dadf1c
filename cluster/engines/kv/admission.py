"""The engine replica's KV budget around each request: the rules are `kv/budget.py`, what waits
is `kv/gate.py`; this admits a turn or queues it, moves a session that waited too long when
another replica could take it, and gives the turn's tokens back when it ends."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import asdict, replace
from typing import Any, AsyncIterator, Callable, Optional

from cluster.config import KvBudgetConfig
from cluster.core.messages import (
    KV_MOVE,
    KV_QUEUE_FULL,
    EngineChunk,
    EngineDone,
    EngineFailure,
    EngineQueued,
    EngineRequest,
    ToolCallPiece,
)
from cluster.engines.base import Engine
from cluster.engines.kv.budget import BudgetPolicy, QueueFull
from cluster.engines.kv.gate import KvGate, pin_key

Stream = Callable[[EngineRequest], AsyncIterator[EngineChunk]]


class KvAdmission:
    def __init__(self, gate: KvGate, config: KvBudgetConfig, engine: Engine, can_move: bool) -> None:
        self.gate = gate
        self.config = config
        self.engine = engine
        self.can_move = can_move  # other replicas could take a session that waits too long here
        self.migrations = 0  # sessions this replica sent elsewhere (no room here for too long)
        self._stats_seq = 0

    @classmethod
    def of(cls, engine: Engine, config: KvBudgetConfig, max_replicas: int) -> Optional[KvAdmission]:
        """The budget for a started engine; None when it is off or the engine's capacity is not
        known (the scripted engine without a modelled cache): nothing to budget."""
        facts = engine.kv_facts()
        capacity = config.capacity_tokens or facts.capacity_tokens
        if not (config.enabled and capacity):
            return None
        policy = BudgetPolicy.of(config, facts.lower_tier_tokens_per_s)
        return cls(KvGate(capacity, policy, block_size=facts.block_size), config, engine, max_replicas > 1)

    async def run(self, req: EngineRequest, stream: Stream) -> AsyncIterator[EngineChunk]:
        """`stream`'s chunks once the turn's tokens fit the budget: a turn that waits says so first
        (`EngineQueued`); when it ends, its session keeps its prefix if it is expected back (its
        socket is open, or it called tools)."""
        gate = self.gate
        key = pin_key(req.cache_salt, req.session_key)
        try:
            ticket, wait = gate.request(key, req.prompt_token_ids, req.generation.max_tokens, image_tokens=req.image_tokens,
                                        tenant=req.cache_salt or "", min_ttl_s=req.cache_ttl_s,
                                        engine_in_use=self.engine.kv_in_use_tokens())
        except QueueFull as full:
            what = "this key's share of the" if full.tenant_limit else "the"
            yield [EngineFailure(429, f"The engine's queue is full ({what} turns waiting for KV room). "
                                      f"Try again in {full.retry_after_s:.0f}s.", code=KV_QUEUE_FULL,
                                 retry_after_s=full.retry_after_s)]
            return
        admitted = False
        held, expect_back, produced = req.engine_len, req.expect_back, None
        try:
            if wait is not None:
                yield [EngineQueued(gate.position(ticket), gate.budget.queued_tokens)]
                if not await self._wait_or_move(wait, key, req):
                    self.migrations += 1
                    yield [EngineFailure(503, "No KV room for this session on its engine replica.", code=KV_MOVE)]
                    return
            admitted = True
            req = replace(req, kv_pin=key, kv_ttl_s=gate.pin_ttl(key), kv_unpin=gate.take_unpins())
            async with aclosing(stream(req)) as chunks:
                async for chunk in chunks:
                    for piece in chunk:
                        if isinstance(piece, ToolCallPiece):
                            expect_back = True
                        elif isinstance(piece, EngineDone):
                            held, produced = piece.prompt_tokens + piece.output_tokens, piece.output_tokens
                            gate.observe_prefill(piece.prompt_tokens - piece.cached_tokens, piece.first_token_s)
                    yield chunk
        finally:
            if admitted:
                gate.finish(ticket, held, expect_back, continuable=req.continuable, output_tokens=produced,
                            close_tells_end=req.close_tells_end)
            else:
                gate.cancel(ticket)

    async def _wait_or_move(self, wait: asyncio.Future, key: str, req: EngineRequest) -> bool:
        """Wait for room; False when the session should move instead: several replicas, it was
        not moved before, it holds nothing here, and it waited `move_after_s`."""
        if req.moved or not self.can_move:
            await wait
            return True
        try:
            await asyncio.wait_for(asyncio.shield(wait), self.config.move_after_s)
            return True
        except asyncio.TimeoutError:
            if wait.done() or self.gate.holds(key):
                await wait
                return True
            return False

    def release(self, session_key: str, cache_salt: Optional[str]) -> None:
        """The session will not be back (its socket closed, nothing stored): its KV goes now."""
        self.gate.release(pin_key(cache_salt, session_key))

    def figures(self) -> dict[str, Any]:
        """The budget's figures, and its count against the engine's own (vLLM's block usage, the
        modelled pool's): drift is positive when the budget reserves more than the engine holds
        (output not yet made)."""
        figures: dict[str, Any] = dict(self.gate.snapshot())
        figures["recent_ends"] = [asdict(e) for e in self.gate.budget.ends]
        in_use = self.engine.kv_in_use_tokens()
        if in_use is not None:
            figures["engine_kv_tokens"] = in_use
            figures["drift_tokens"] = self.gate.budget.used - in_use
        return figures

    def routing_stats(self) -> dict[str, Any]:
        """What the KV placement router (cluster/serve_plugins/kv_router.py) places new sessions by."""
        self._stats_seq += 1  # routers count their own placements until the next one
        budget = self.gate.budget
        return {"kv_headroom": budget.headroom(), "kv_capacity": budget.capacity,
                "kv_session_tokens": budget.session_tokens(), "kv_stats_seq": self._stats_seq}

    def autoscaling_stats(self) -> dict[str, float]:
        """KV demand (running + retained + queued tokens over capacity) and queue wait."""
        return {"kv_demand": float(self.gate.budget.demand()),
                "kv_head_wait_s": float(self.gate.snapshot()["head_wait_s"])}

    async def drain(self, keep: Callable[[Callable[[EngineRequest], bool]], None],
                    in_flight: Callable[[], int], window_s: float) -> None:
        """Leaving: sessions retained here keep their turns on this replica (`keep` tells the
        channel which) until their retention runs out or `window_s` passes."""
        gate = self.gate
        if not gate.retaining():
            return
        keep(lambda req: gate.holds(pin_key(req.cache_salt, req.session_key)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window_s
        while loop.time() < deadline and (gate.retaining() or in_flight()):
            await asyncio.sleep(0.2)
