"""Post-inference work, scheduled after a turn and never awaited by it.

Persisting, metering, safety bookkeeping and trace export run as tasks owned by
the replica (not by the connection): the next `response.create` never waits for
them and a client that disconnects does not cancel them. A failing hook is
retried with backoff; what still fails is counted, not raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Iterable, Optional

from cluster.core.retry import RetryPolicy
from cluster.core.turn.cache import items_nbytes

log = logging.getLogger(__name__)


@dataclass
class TurnRecord:
    response_id: str
    model: str
    owner: Optional[str]
    status: str  # completed | incomplete | failed | cancelled
    usage: dict[str, Any]
    store: bool
    response: Optional[dict[str, Any]] = None
    safety: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)
    finished_at: float = field(default_factory=time.time)
    # Called by output-safety post-work when the output's tail is flagged late.
    on_late_flag: Optional[Callable[[dict[str, Any]], None]] = None
    state: Any = None  # the committed ResponseState (None if the turn did not commit)
    trace: Any = None  # the turn's OpenTelemetry context: each hook is a child span


Hook = Callable[[TurnRecord], Awaitable[None]]


def record_nbytes(record: TurnRecord) -> int:
    """What a record keeps alive: its state (the whole context) or, without one, its response."""
    held = getattr(record.state, "nbytes", 0) or 0
    return 1024 + (held or items_nbytes([record.response or {}]))  # counted, never serialized


class PostWorkQueue:
    def __init__(self, hooks: Optional[dict[str, Hook]] = None, *, retries: int = 3, backoff_s: float = 0.2,
                 tracer: Any = None, max_retry_bytes: int = 256 * 1024 * 1024, attempt_timeout_s: float = 30.0) -> None:
        from cluster import telemetry

        self.tracer = tracer or telemetry.tracer()
        self.hooks: dict[str, Hook] = dict(hooks or {})
        self.retry = RetryPolicy(retries=retries, backoff_s=backoff_s)
        self._retry: dict[str, RetryPolicy] = {}  # hooks retried until a deadline instead
        self._tasks: set[asyncio.Task] = set()
        self._by_response: dict[str, set[asyncio.Task]] = {}  # what `settle` waits for
        self.scheduled = self.completed = self.failed = self.retried = 0
        # Records waiting to be retried keep their whole state alive: a slow store must not grow
        # memory past the caches' bounds. Past this many bytes, a retry is given up (counted in
        # `dropped`, logged with the response id; a stored response is then missing from the store,
        # as after a failed write) instead of held.
        self.max_retry_bytes = max_retry_bytes
        self.retry_bytes = 0
        self.dropped = 0
        self.attempt_timeout_s = attempt_timeout_s  # a hook that hangs is an attempt that failed
        self.retried_by: Counter[str] = Counter()
        self.failed_by: Counter[str] = Counter()

    def add(self, name: str, hook: Hook, *, retry_for_s: Optional[float] = None) -> None:
        """`retry_for_s`: keep retrying (backoff doubling up to 5 s) for that long, e.g. a store restarting."""
        self.hooks[name] = hook
        if retry_for_s is not None:
            self._retry[name] = replace(self.retry, deadline_s=retry_for_s)

    def schedule(self, record: TurnRecord) -> None:
        """Start every hook for `record` in the background and return at once."""
        for name, hook in self.hooks.items():
            self.scheduled += 1
            task = asyncio.get_running_loop().create_task(self._run(name, hook, record), name=f"post-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            tasks = self._by_response.setdefault(record.response_id, set())
            tasks.add(task)
            task.add_done_callback(lambda t, rid=record.response_id: self._forget(rid, t))

    def _forget(self, response_id: str, task: asyncio.Task) -> None:
        tasks = self._by_response.get(response_id)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._by_response[response_id]

    async def _run(self, name: str, hook: Hook, record: TurnRecord) -> None:
        with self.tracer.start_as_current_span(f"post_work.{name}", context=record.trace) as span:
            await self._attempts(name, hook, record, span)

    async def _attempts(self, name: str, hook: Hook, record: TurnRecord, span) -> None:
        policy = self._retry.get(name, self.retry)
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                await asyncio.wait_for(hook(record), self.attempt_timeout_s)
                self.completed += 1
                span.set_attribute("loopserve.attempts", attempt + 1)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if policy.gives_up(attempt, started):
                    self.failed += 1
                    self.failed_by[name] += 1
                    log.error("post-inference hook %s failed for %s after %d attempts: %s", name,
                              record.response_id, attempt + 1, type(exc).__name__)
                    return
                held = record_nbytes(record)
                if self.retry_bytes + held > self.max_retry_bytes:
                    self.dropped += 1
                    self.failed_by[name] += 1
                    log.error("post-inference hook %s for %s dropped: %d bytes already wait for a retry",
                              name, record.response_id, self.retry_bytes)
                    return
                self.retried += 1
                self.retried_by[name] += 1
                self.retry_bytes += held
                try:
                    await asyncio.sleep(policy.delay(attempt))
                finally:
                    self.retry_bytes -= held
                attempt += 1

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def settle(self, response_ids: Iterable[str], timeout: float) -> bool:
        """Wait (at most `timeout`) for the work scheduled for these responses: before a draining
        socket tells its client to reconnect elsewhere, its responses must be in the store the
        next replica reads. True when all of it finished."""
        tasks = set().union(*(self._by_response.get(rid, ()) for rid in response_ids))
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        return not pending

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait for scheduled work (shutdown, tests)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    def stats(self) -> dict[str, int]:
        return {
            "scheduled": self.scheduled,
            "completed": self.completed,
            "failed": self.failed,
            "retried": self.retried,
            "pending": self.pending,
            "dropped": self.dropped,
            "retry_bytes": self.retry_bytes,
        }


class UsageMeter:
    """Tokens in / cached / out and requests, per (owner, model)."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, str], dict[str, int]] = defaultdict(
            lambda: {"requests": 0, "input_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
        )

    async def __call__(self, record: TurnRecord) -> None:
        t = self.totals[(record.owner or "anonymous", record.model)]
        usage = record.usage or {}
        t["requests"] += 1
        t["input_tokens"] += int(usage.get("input_tokens") or 0)
        t["cached_tokens"] += int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        t["output_tokens"] += int(usage.get("output_tokens") or 0)

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"owner": o, "model": m, **v} for (o, m), v in self.totals.items()]


class SafetyLedger:
    """Output-safety bookkeeping: flagged turns per category, characters classified."""

    def __init__(self) -> None:
        self.flagged: dict[str, int] = defaultdict(int)
        self.input_chars = 0
        self.output_chars = 0
        self.turns = 0

    async def __call__(self, record: TurnRecord) -> None:
        s = record.safety or {}
        self.turns += 1
        self.input_chars += int(s.get("input_chars", 0))
        self.output_chars += int(s.get("output_chars", 0))
        if s.get("flag"):
            self.flagged[f"{s['flag'].get('stage', '?')}:{s['flag'].get('category') or 'unknown'}"] += 1

    def snapshot(self) -> dict[str, Any]:
        return {"turns": self.turns, "input_chars": self.input_chars, "output_chars": self.output_chars,
                "flagged": dict(self.flagged)}


def load_hook(spec: str, config: Any) -> Hook:
    """`package.module:factory` -> factory(config), an async hook."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"post-work hook {spec!r} must look like 'package.module:factory'")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(config)


class OutputTailCheck:
    """Classifies the output text no chunk check covered, after the terminal event.

    A flag there blocks continuations of the response (`on_late_flag`) and is
    counted by the ledger as `output-late:<category>`.
    """

    def __init__(self, classify: Callable[[list[str]], Awaitable[list[dict[str, Any]]]], ledger: "SafetyLedger",
                 on_flagged: Optional[Callable[[TurnRecord], Awaitable[None]]] = None) -> None:
        self._classify = classify
        self._ledger = ledger
        self._on_flagged = on_flagged  # e.g. make the flag durable in the store

    async def __call__(self, record: TurnRecord) -> None:
        tail = (record.safety or {}).get("tail")
        if not tail:
            return
        self._ledger.output_chars += len(tail)
        hit = next((v for v in await self._classify([tail]) if v.get("flagged")), None)
        if hit:
            self._ledger.flagged[f"output-late:{hit.get('category') or 'unknown'}"] += 1
            if record.on_late_flag is not None:
                record.on_late_flag({**hit, "stage": "output"})
            if self._on_flagged is not None:
                await self._on_flagged(record)
