"""One retry policy: when a failed call is tried again and how long to wait first.

Used for every deployment call (render, safety, an engine stream before its
first chunk) and for post-inference work. Plain asyncio, no Ray: the caller
says which errors are retryable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional, TypeVar

log = logging.getLogger("loopserve.retry")
T = TypeVar("T")
Retryable = Callable[[BaseException], bool]


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3  # attempts after the first (ignored when `deadline_s` is set)
    backoff_s: float = 0.2  # the first wait
    multiplier: float = 2.0  # each wait is this much longer than the previous ...
    max_delay_s: float = 5.0  # ... up to this
    # Retry until this long after the first attempt instead (a store restarting, a failover).
    deadline_s: Optional[float] = None

    def delay(self, attempt: int) -> float:
        """The wait before attempt `attempt + 1` (attempt 0 is the first try)."""
        return min(self.backoff_s * self.multiplier**attempt, self.max_delay_s)

    def gives_up(self, attempt: int, started: float) -> bool:
        """After failed attempt number `attempt` (0-based) of a call started at `started` (monotonic)."""
        if self.deadline_s is not None:
            return time.monotonic() + self.delay(attempt) - started > self.deadline_s
        return attempt >= self.retries

    async def call(self, what: str, fn: Callable[[], Awaitable[T]], retryable: Retryable) -> T:
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return await fn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not retryable(exc) or self.gives_up(attempt, started):
                    raise
                log.warning("%s failed (%s); retrying (attempt %d)", what, type(exc).__name__, attempt + 1)
                await asyncio.sleep(self.delay(attempt))
                attempt += 1

    async def stream(self, what: str, open_stream: Callable[[], AsyncIterator[T]],
                     retryable: Retryable) -> AsyncIterator[T]:
        """Items of a stream; a stream that fails before its first item is opened again.
        A failure after that is raised (its items were already used)."""
        started = time.monotonic()
        attempt = 0
        while True:
            stream = open_stream()
            begun = False
            try:
                async for item in stream:
                    begun = True
                    yield item
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if begun or not retryable(exc) or self.gives_up(attempt, started):
                    raise
                log.warning("%s failed before its first item (%s); retrying (attempt %d)", what,
                            type(exc).__name__, attempt + 1)
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
            await asyncio.sleep(self.delay(attempt))
            attempt += 1
