"""The engine replica's destructor, which Serve also runs after a constructor that failed part-way."""

from __future__ import annotations

import pytest

from actors.engine import EngineReplica
from cluster.core.messages import Generation
from cluster.engines.scripted.engine import ScriptedEngine


# Serve awaits `__del__` itself; when the test's replica object is collected, Python calls it again
# as a plain destructor, which only makes (and drops) a coroutine.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'EngineReplica.__del__' was never awaited")


class RecordingScriptedEngine(ScriptedEngine):
    """The real scripted engine, remembering that it was shut down."""

    shut_down = False

    async def shutdown(self) -> None:
        self.shut_down = True
        await super().shutdown()


async def test_the_destructor_shuts_its_engine_down(tiny_model_dir):
    from cluster.config import LoopserveConfig
    from cluster.engines.service import EngineService

    replica = object.__new__(EngineReplica.func_or_class)  # the constructor got as far as the service
    replica.service = await EngineService.build(LoopserveConfig(engine={"backend": "scripted"}), RecordingScriptedEngine)
    await replica.__del__()
    assert replica.service.engine.shut_down


async def test_a_replica_that_failed_before_its_engine_existed_stops_without_an_error():
    replica = object.__new__(EngineReplica.func_or_class)  # e.g. its tokenizer did not load
    await replica.__del__()


async def test_a_full_kv_queue_refuses_a_turn_with_a_429_that_says_when_to_retry(tiny_model_dir):
    """The real replica class (constructed outside Serve) on the scripted engine with its modelled
    KV: one turn runs, one waits, the next one is refused, and the client learns when to retry."""
    import asyncio
    from array import array

    from cluster.config import LoopserveConfig
    from cluster.core.messages import KV_QUEUE_FULL, EngineDone, EngineFailure, EngineQueued, EngineRequest
    from cluster.core.turn.turn import cache_salt

    config = LoopserveConfig(engine={"backend": "scripted", "direct_stream": False, "kv_budget": {"max_queued_turns": 1},
                                     "scripted": {"kv_capacity_tokens": 2048, "tokens_per_second": 10}})
    replica = EngineReplica.func_or_class.__new__(EngineReplica.func_or_class)
    await replica.__init__(config)
    try:
        def request(i: int) -> EngineRequest:
            return EngineRequest(f"r{i}", f"s{i}", array("i", [100 + i] * 1500), Generation(8), cache_salt=cache_salt("t"))

        async def pieces(i: int) -> list:
            return [p async for chunk in replica.generate(request(i)) for p in chunk]

        first = asyncio.ensure_future(pieces(1))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(pieces(2))
        await asyncio.sleep(0.01)
        third = await pieces(3)
        assert isinstance(third[0], EngineFailure) and third[0].status == 429 and third[0].code == KV_QUEUE_FULL
        assert third[0].retry_after_s >= 1 and third[0].error().retry_after_s == third[0].retry_after_s
        done = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert isinstance(done[0][-1], EngineDone)
        assert isinstance(done[1][0], EngineQueued) and isinstance(done[1][-1], EngineDone)  # waited, then ran
        assert replica.kv_figures()["refused"] == 1
    finally:
        await replica.__del__()


def test_a_429_carries_retry_after_in_the_http_response():
    from actors.http import error_response
    from cluster.protocol.errors import ApiError

    response = error_response(ApiError(429, "busy", code="kv_queue_full", retry_after_s=2.2))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert error_response(ApiError(400, "bad")).headers.get("retry-after") is None


async def test_a_leaving_replica_serves_its_retained_sessions_over_its_channel_until_their_retention_ends(
        tiny_model_dir):
    """Scale-down or redeploy: Serve routes no new session to a stopping replica; the sessions it
    retains keep their turns there (their prefix is there) until their retention runs out, and only
    then does it close and stop. The real replica class and channel, outside Serve."""
    import asyncio
    from array import array
    from dataclasses import replace

    from cluster.config import LoopserveConfig
    from cluster.core.messages import EngineDone, EngineRequest
    from cluster.engines.channel import ChannelError, ChannelPool

    config = LoopserveConfig(engine={"backend": "scripted", "kv_budget": {"ttl_initial_s": 1.5, "ttl_min_s": 1.5},
                                     "scripted": {"kv_capacity_tokens": 4096, "tokens_per_second": 1000}},
                             engine_deployment={"graceful_shutdown_timeout_s": 30})
    replica = EngineReplica.func_or_class.__new__(EngineReplica.func_or_class)
    await replica.__init__(config)
    pool, loop = ChannelPool(), asyncio.get_running_loop()
    endpoint = replica.channel.endpoint

    async def done_of(req: EngineRequest) -> EngineDone:
        return [p async for chunk in pool.stream(endpoint, req) for p in chunk if isinstance(p, EngineDone)][-1]

    try:
        first = EngineRequest("r1", "kept", array("i", range(40, 240)), Generation(4), expect_back=True)
        await done_of(first)
        leaving = asyncio.ensure_future(replica.__del__())
        started = loop.time()
        await asyncio.sleep(0.3)
        assert (await replica.channel_endpoint())[0] == ""  # no new session is placed here
        again = await done_of(replace(first, request_id="r2", prompt_token_ids=array("i", range(40, 300))))
        assert again.cached_tokens >= 160  # served here, from its retained prefix
        with pytest.raises(ChannelError):  # a session with nothing here goes back to be placed elsewhere
            await done_of(EngineRequest("r3", "other", array("i", range(500, 600)), Generation(4)))
        await asyncio.wait_for(leaving, 20)
        assert loop.time() - started >= 1.5  # it stopped once the kept session's retention ran out
    finally:
        await pool.close()
        if not replica.channel.closing:
            await replica.__del__()
