"""Watching the replica's event loop: how late its timer fires, and how long full garbage
collections take (`telemetry.LoopHealth`, shown in `/loopserve/stats` under `loop`)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Optional

from cluster.telemetry import LoopHealth

log = logging.getLogger("loopserve.loop")

TICK_S = 0.05
# A stall this long is logged with its stack: every socket of the replica waited through it.
WARN_S = float(os.environ.get("LOOPSERVE_LOOP_STALL_S", "1.0"))


class LoopWatch:
    """The loop's timer and a watchdog thread: when the timer has not fired for WARN_S, the
    watchdog logs the stack the loop's thread is in (what held it), once per stall, and keeps the
    last few for `/loopserve/stats`."""

    def __init__(self, health: LoopHealth) -> None:
        self.health = health
        self._task: Optional[asyncio.Task] = None
        self._gc_started: Optional[float] = None
        self._ticked = time.perf_counter()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._loop_thread = threading.get_ident()
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-watch")
        threading.Thread(target=self._watchdog, name="loop-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        reported = 0.0
        while not self._stop.wait(WARN_S / 4):
            ticked = self._ticked
            if time.perf_counter() - ticked < WARN_S or ticked == reported:
                continue
            reported = ticked
            frame = sys._current_frames().get(self._loop_thread)
            stack = "".join(traceback.format_stack(frame, limit=16)) if frame is not None else "(no frame)"
            log.warning("the event loop has been held over %.1f s, in:\n%s", WARN_S, stack)
            self.health.stalls = [*self.health.stalls[-4:], stack[-3000:]]

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            took = time.perf_counter() - self._gc_started
            self._gc_started = None
            h = self.health
            h.gc_full += 1
            h.gc_full_s += took
            h.gc_full_max_s = max(h.gc_full_max_s, took)
            if took > WARN_S:
                log.warning("a full garbage collection held the event loop %.2f s", took)

    async def _tick(self) -> None:
        h = self.health
        while True:
            t0 = self._ticked = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late = time.perf_counter() - t0 - TICK_S
            h.lag_max_s = max(h.lag_max_s, late)
            if late > 0.1:
                h.lags_over_100ms += 1
                h.lag_over_100ms_s += late
                if late > WARN_S:
                    log.warning("the event loop was held %.2f s: every socket of this replica waited", late)

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
