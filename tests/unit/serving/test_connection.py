"""The connection replica's services: /health's readiness check is shared (it is open
to anyone, and each check asks every deployment for its stats)."""

import asyncio

import pytest

from cluster.serving.connection import SharedCheck


async def test_callers_within_the_ttl_share_one_check_and_its_failure():
    calls = []
    failing = [False]

    async def check():
        calls.append(1)
        await asyncio.sleep(0.01)
        if failing[0]:
            raise RuntimeError("engine down")

    shared = SharedCheck(check, ttl_s=0.2)
    await asyncio.gather(*(shared() for _ in range(64)))
    await shared()
    assert len(calls) == 1
    await asyncio.sleep(0.25)
    failing[0] = True
    with pytest.raises(RuntimeError):
        await shared()
    with pytest.raises(RuntimeError):  # the failure is shared too, not checked again at once
        await shared()
    assert len(calls) == 2
    failing[0] = False
    await asyncio.sleep(0.25)
    await shared()
    assert len(calls) == 3
