"""The engine replica's serving logic without Ray (cluster/engines/service.py)."""

from __future__ import annotations

import pytest

from cluster.core.messages import Generation
from cluster.config import LoopserveConfig
from cluster.engines import service as service_module
from cluster.engines.scripted.engine import ScriptedEngine
from cluster.engines.service import EngineService


class RecordingScriptedEngine(ScriptedEngine):
    """The real scripted engine, remembering its instances and whether each was shut down."""

    made: list[RecordingScriptedEngine] = []
    shut_down = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        RecordingScriptedEngine.made.append(self)

    async def shutdown(self) -> None:
        self.shut_down = True
        await super().shutdown()


async def test_an_engine_started_before_a_later_step_failed_is_shut_down(tiny_model_dir, monkeypatch):
    """Its processes (vLLM's engine core) would outlive the replica Serve gives up on."""
    def no_budget(*_):
        raise RuntimeError("the KV budget could not be sized")

    monkeypatch.setattr(service_module.KvAdmission, "of", no_budget)
    RecordingScriptedEngine.made.clear()
    with pytest.raises(RuntimeError, match="could not be sized"):
        await EngineService.build(LoopserveConfig(engine={"backend": "scripted"}), RecordingScriptedEngine)
    (engine,) = RecordingScriptedEngine.made
    assert engine.shut_down


async def test_a_continuation_sends_its_tail_and_the_figures_say_what_was_kept(tiny_model_dir):
    from array import array

    from cluster.core.messages import EngineDone, EngineRequest

    config = LoopserveConfig(engine={"backend": "scripted", "scripted": {"kv_capacity_tokens": 4096}})
    service = await EngineService.build(config)
    first = EngineRequest("r1", "s", array("i", range(100, 300)), Generation(4))
    pieces = [p async for chunk in service.generate(first) for p in chunk]
    assert isinstance(pieces[-1], EngineDone) and pieces[-1].prompt_tokens == 200
    tail = EngineRequest("r2", "s", array("i", range(300, 320)), Generation(4), base_request_id="r1", base_len=200)
    pieces = [p async for chunk in service.generate(tail) for p in chunk]
    assert pieces[-1].prompt_tokens == 220  # the base came from the session's last prompt, kept here
    stats = service.stats()
    assert stats["session_prompts"]["hits"] == 1 and set(stats["prompt_digests"]) == {"r1", "r2"}
    assert stats["kv"]["capacity_tokens"] == 4096 and stats["in_flight"] == 0
    await service.engine.shutdown()
