"""Post-work hooks for benchmarks (importable by Ray workers started from the repo root)."""

import asyncio


def slow_hook(config, delay_s: float = 1.0):
    """A post-inference hook that takes `delay_s` (a slow store or billing API)."""

    async def hook(record):
        await asyncio.sleep(delay_s)

    return hook
