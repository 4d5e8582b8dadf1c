"""The connection replica's loop watch: a held event loop is measured, and the stack that held
it is kept for /loopserve/stats (what an operator needs to find a stall every socket saw)."""

import asyncio
import gc
import time

from actors.loop_watch import LoopWatch
from cluster.telemetry import LoopHealth


def hold_the_loop(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def test_a_held_loop_is_measured_with_the_stack_that_held_it():
    health = LoopHealth()
    watch = LoopWatch(health)
    watch.start()
    try:
        await asyncio.sleep(0.1)
        hold_the_loop(1.4)
        await asyncio.sleep(0.1)
        gc.collect()
    finally:
        watch.stop()
    assert health.lag_max_s > 1.2 and health.lags_over_100ms == 1
    assert len(health.stalls) == 1 and "hold_the_loop" in health.stalls[0]
    assert health.gc_full >= 1
