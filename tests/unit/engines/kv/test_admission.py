"""The engine replica's KV admission around a request (cluster/engines/kv/admission.py), on an
event loop without Ray: what waits is announced, what ends gives its tokens back, and a session
that waits too long on a replica of several is told to move."""

from __future__ import annotations

import asyncio
from array import array
from typing import Optional

from cluster.core.messages import Generation
from cluster.config import KvBudgetConfig
from cluster.core.messages import KV_MOVE, KV_QUEUE_FULL, EngineDone, EngineFailure, EngineQueued, EngineRequest
from cluster.engines.base import KvFacts
from cluster.engines.kv.admission import KvAdmission


class FakeKvEngine:
    """A fake engine: only what the admission reads of one (its KV facts and in-use count)."""

    def __init__(self, capacity: int, block: int = 16) -> None:
        self.facts = KvFacts(capacity, block, None)
        self.in_use: Optional[int] = None

    def kv_facts(self) -> KvFacts:
        return self.facts

    def kv_in_use_tokens(self) -> Optional[int]:
        return self.in_use


def request(rid: str, session: str, tokens: int, moved: bool = False) -> EngineRequest:
    start = sum(map(ord, session)) * 100_000  # no two sessions share a prefix (the budget counts a shared one once)
    return EngineRequest(rid, session, array("i", range(start, start + tokens)), Generation(16), moved=moved, expect_back=True)


def stream_until(release: asyncio.Event, seen: list[EngineRequest]):
    async def stream(req: EngineRequest):
        seen.append(req)
        await release.wait()
        yield [EngineDone(len(req.prompt_token_ids), 0, 4, "stop")]
    return stream


def test_no_budget_without_a_known_capacity_or_when_off():
    assert KvAdmission.of(FakeKvEngine(0), KvBudgetConfig(), max_replicas=1) is None
    assert KvAdmission.of(FakeKvEngine(4096), KvBudgetConfig(enabled=False), max_replicas=1) is None
    assert KvAdmission.of(FakeKvEngine(0), KvBudgetConfig(capacity_tokens=2048), max_replicas=1) is not None


async def test_a_turn_that_does_not_fit_is_announced_then_runs_when_the_first_ends():
    admission = KvAdmission.of(FakeKvEngine(1024), KvBudgetConfig(retention=False), max_replicas=1)
    release, seen = asyncio.Event(), []
    first = admission.run(request("r1", "a", 700), stream_until(release, seen))
    second = admission.run(request("r2", "b", 700), stream_until(release, seen))
    running = asyncio.create_task(anext(first))
    await asyncio.sleep(0)
    assert [r.request_id for r in seen] == ["r1"] and seen[0].kv_pin  # admitted: the engine pins its session
    (queued,) = await anext(second)
    assert isinstance(queued, EngineQueued) and queued.position == 1
    waiting = asyncio.create_task(anext(second))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # no room while the first runs
    release.set()
    assert isinstance((await running)[0], EngineDone)
    assert await anext(first, None) is None  # the first ends: its tokens go back
    assert isinstance((await asyncio.wait_for(waiting, 2))[0], EngineDone)
    assert [r.request_id for r in seen] == ["r1", "r2"]
    await second.aclose()
    assert admission.figures()["queued_turns"] == 0


async def test_a_full_queue_is_a_429_and_a_long_wait_on_one_of_several_replicas_a_move():
    cfg = KvBudgetConfig(retention=False, max_queued_turns=1, move_after_s=0.05)
    admission = KvAdmission.of(FakeKvEngine(1024), cfg, max_replicas=2)
    release, seen = asyncio.Event(), []
    first = admission.run(request("r1", "a", 900), stream_until(release, seen))
    running = asyncio.create_task(anext(first))
    await asyncio.sleep(0)
    waiter = admission.run(request("r2", "b", 900), stream_until(release, seen))
    assert isinstance((await anext(waiter))[0], EngineQueued)
    (full,) = await anext(admission.run(request("r3", "c", 900), stream_until(release, seen)))
    assert isinstance(full, EngineFailure) and (full.status, full.code) == (429, KV_QUEUE_FULL)
    (moved,) = await asyncio.wait_for(anext(waiter), 2)  # it held nothing here and waited move_after_s
    assert isinstance(moved, EngineFailure) and (moved.status, moved.code) == (503, KV_MOVE)
    assert admission.migrations == 1
    release.set()
    await running
    await first.aclose()


async def test_stats_say_why_a_retention_went_and_name_no_session():
    admission = KvAdmission.of(FakeKvEngine(4096), KvBudgetConfig(), max_replicas=1)
    release, seen = asyncio.Event(), []
    release.set()
    async for _ in admission.run(request("r1", "secret-session", 700), stream_until(release, seen)):
        pass
    admission.release("secret-session", None)  # its socket closed
    (end,) = admission.figures()["recent_ends"]
    assert (end["why"], end["tokens"], end["turns"]) == ("released", 704, 1)
    assert "secret-session" not in repr(admission.figures())
