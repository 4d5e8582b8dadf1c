"""Knowing that this replica is being drained (scale-down, redeploy, node drain).

Ray Serve drains a replica by waiting for its ongoing requests, and a WebSocket
is an ongoing request for its whole life: left alone, a scaled-down connection
replica waits out `graceful_shutdown_timeout_s` and is then killed under its
sockets, mid-turn. Serve does not tell user code that draining started (the
flag is `Replica._shutting_down`, internal), so `DrainWatch` reads that flag.
If a later Ray renames it, the probe finds nothing, logs it once, and sockets
end at the timeout as before: degraded, never wrong.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Awaitable, Callable, Optional

log = logging.getLogger("loopserve.drain")


def replica_draining_probe() -> Optional[Callable[[], bool]]:
    """A callable telling whether this process's Serve replica is draining (None outside Serve)."""
    try:
        from ray.serve._private.replica import Replica
    except ImportError:
        return None
    for obj in gc.get_objects():
        if isinstance(obj, Replica) and hasattr(obj, "_shutting_down"):
            return lambda: bool(obj._shutting_down)
    return None


class DrainWatch:
    """Polls the probe; calls `on_drain` once when draining starts."""

    def __init__(self, on_drain: Callable[[], Awaitable[None]], period_s: float = 0.25,
                 probe: Optional[Callable[[], bool]] = None) -> None:
        self.on_drain = on_drain
        self.period_s = period_s
        self.probe = probe
        self.draining = False
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self.probe is None:
            self.probe = replica_draining_probe()
        if self.probe is None:
            log.warning("cannot see Serve's draining state: WebSockets will end at the graceful shutdown timeout")
            return
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="drain-watch")

    async def _watch(self) -> None:
        while not self.probe():
            await asyncio.sleep(self.period_s)
        self.draining = True
        log.info("replica draining: finishing in-flight turns, closing sockets for reconnection")
        await self.on_drain()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
