"""vLLM's scheduler with session pins: a retained session's KV blocks stay while others run.

vLLM (0.32) frees a finished request's blocks to the tail of one free queue and
allocates from its head, so the least recently freed cached blocks go first,
whoever they belong to; it has no per-prefix pin. The engine replica's KV budget
(`kv/budget.py`) decides which sessions are expected back; this scheduler keeps
their blocks, loaded through vLLM's own extension point (`scheduler_cls`):

- A request whose sampling params carry `extra_args["loopserve_kv"]["pin"]` (a
  session id) and a TTL has its cached (full, hashed) blocks referenced once more
  when it ends: they leave the free queue and no allocation can take them. The
  session's previous pin is dropped after the new one is taken (shared blocks never
  reach the free queue in between).
- `unpin` (ids whose retention the budget ended) rides on the next request: pins
  only matter when a request needs blocks, and that request carries them. A pin also
  ends at its own TTL (the budget's, measured here).
- Unpinned blocks go to the free queue's tail: still cached, reusable until evicted.
- Pressure valve: when an allocation fails while pins are held (the budget's count of
  tokens and vLLM's blocks differ by rounding and by requests the budget did not see),
  the oldest pins are dropped before vLLM would preempt or hold a request back. Pins
  never cost a preemption.

Pinning takes a reference exactly as a prefix-cache hit by another request does
(`BlockPool.touch`), so vLLM's own accounting (free counts, usage, eviction) stays
consistent. The engine core runs in its own process; nothing here is called from
the replica's side. Why not the alternatives: touching a retained prefix with a
1-token request costs a forward pass per session per touch, and vLLM's KV offloading
connector has no CPU-platform tier to offload to (the KV already lives in RAM here).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from cluster.engines.vllm.retention_guard import TESTED_VLLM  # noqa: F401 - the range these internals were read from

HINT = "loopserve_kv"


def _hint(request: Any) -> dict[str, Any]:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    hint = extra.get(HINT)
    return hint if isinstance(hint, dict) else {}


class RetainingMixin:
    """Session pins for a vLLM v1 scheduler (mixed into `Scheduler` or `AsyncScheduler`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pins: OrderedDict[str, tuple[list, float]] = OrderedDict()  # session -> (blocks, expiry)
        self._pin_for: dict[str, tuple[str, float]] = {}  # request id -> (session, ttl)
        self._next_expiry = float("inf")
        self._preempting: Any = None  # the request being preempted: it runs again, no pin yet
        self.pins_dropped_under_pressure = 0
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def allocate_slots(*a: Any, **kw: Any):
            blocks = allocate(*a, **kw)
            while blocks is None and self._pins:
                self.pins_dropped_under_pressure += 1
                self._unpin(next(iter(self._pins)))
                blocks = allocate(*a, **kw)
            return blocks

        manager.allocate_slots = allocate_slots

    def add_request(self, request: Any) -> None:
        hint = _hint(request)
        for session in hint.get("unpin") or ():
            self._unpin(str(session))
        if hint.get("pin") and float(hint.get("ttl") or 0) > 0:
            self._pin_for[request.request_id] = (str(hint["pin"]), float(hint["ttl"]))
        self._expire()
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any):
        if self._next_expiry <= time.monotonic():
            self._expire()
        return super().schedule(*args, **kwargs)

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM frees a preempted request's blocks through `_free_request_blocks` too: it will run
        # again, so its pin waits for its real end.
        self._preempting = request.request_id
        try:
            return super()._preempt_request(request, *args, **kwargs)
        finally:
            self._preempting = None

    def _free_request_blocks(self, request: Any) -> None:
        if request.request_id != self._preempting:
            pin = self._pin_for.pop(request.request_id, None)
            if pin is not None:
                self._pin(request.request_id, *pin)
        super()._free_request_blocks(request)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        out = super().finish_requests(request_ids, finished_status)
        ids = (request_ids,) if isinstance(request_ids, str) else (request_ids or ())
        for rid in ids:
            self._pin_for.pop(rid, None)  # never scheduled: nothing to pin
        return out

    # -- pins -------------------------------------------------------------------------

    def _pin(self, request_id: str, session: str, ttl: float) -> None:
        try:
            groups = self.kv_cache_manager.get_blocks(request_id).blocks
        except (KeyError, AttributeError):  # never allocated (aborted while waiting)
            return
        blocks = [b for group in groups for b in group if not b.is_null and b.block_hash is not None]
        pool = self.kv_cache_manager.block_pool
        pool.touch(blocks)  # one more reference: out of the free queue until unpinned
        old = self._pins.pop(session, None)
        expiry = time.monotonic() + ttl
        self._pins[session] = (blocks, expiry)
        self._next_expiry = min(self._next_expiry, expiry)
        if old is not None:
            pool.free_blocks(reversed(old[0]))

    def _unpin(self, session: str) -> None:
        entry = self._pins.pop(session, None)
        if entry is not None:
            # Reversed: the tail of the prefix goes first when these are evicted, as vLLM frees.
            self.kv_cache_manager.block_pool.free_blocks(reversed(entry[0]))

    def _expire(self) -> None:
        now = time.monotonic()
        for session in [s for s, (_, expiry) in self._pins.items() if expiry <= now]:
            self._unpin(session)
        self._next_expiry = min((e for _, e in self._pins.values()), default=float("inf"))

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        for session in list(self._pins):
            self._unpin(session)
        return super().reset_prefix_cache(*args, **kwargs)


class RetainingScheduler(RetainingMixin, Scheduler):
    pass


def retaining_scheduler_for(async_scheduling: bool) -> str:
    """The qualified name vLLM's `scheduler_cls` takes, matching the scheduler vLLM chose."""
    return f"{__name__}.RetainingAsyncScheduler" if async_scheduling else f"{__name__}.RetainingScheduler"


def __getattr__(name: str) -> Any:
    # The async variant is built on first use: its module is only imported when vLLM runs it.
    if name == "RetainingAsyncScheduler":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        cls = type("RetainingAsyncScheduler", (RetainingMixin, AsyncScheduler), {"__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(name)
