"""The garbage collector's thresholds on a replica whose event loop carries many sessions."""

from __future__ import annotations

import gc
import os
from typing import Optional

# Python's (700, 10, 10) promote every object alive across a few hundred allocations; at 1,000
# sessions a turn's in-flight objects were promoted by the thousand, and full collections walking
# every session's state ran 27 times in a 26 s run, 11.8 s of it (the loop held 0.4-0.6 s each).
# With these, young collections come every 50,000 allocations, so a turn's objects die before one
# sees them: no full collections, and a turn's CPU and p99 fell by a third (`loopserve bench load
# --sessions 1000 --turns 10`; the run is in docs/benchmarks-history.md). Serve freezes what
# the constructor made (RAY_SERVE_FREEZE_GC_ON_STARTUP). `LOOPSERVE_GC_THRESHOLDS=700,10,10`
# restores Python's.
GC_THRESHOLDS = tuple(int(x) for x in os.environ.get("LOOPSERVE_GC_THRESHOLDS", "50000,20,100").split(","))


class CollectorThresholds:
    """Sets GC_THRESHOLDS for the replica's life and gives the collector's own back on restore."""

    def __init__(self, thresholds: tuple[int, ...] = GC_THRESHOLDS) -> None:
        self.thresholds = thresholds
        self._before: Optional[tuple[int, ...]] = None

    def apply(self) -> None:
        if self._before is None:
            self._before = gc.get_threshold()
        gc.set_threshold(*self.thresholds)

    def restore(self) -> None:
        if self._before is not None:
            gc.set_threshold(*self._before)
            self._before = None
