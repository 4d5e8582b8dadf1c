"""The engine replica's destructor, which Serve also runs after a constructor that failed part-way."""

from __future__ import annotations

import pytest

from actors.engine import EngineReplica
from cluster.config import ModelConfig, ScriptedEngineConfig
from cluster.engines.scripted import ScriptedEngine


# Serve awaits `__del__` itself; when the test's replica object is collected, Python calls it again
# as a plain destructor, which only makes (and drops) a coroutine.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'EngineReplica.__del__' was never awaited")


class RecordingScriptedEngine(ScriptedEngine):
    """The real scripted engine, remembering that it was shut down."""

    shut_down = False

    async def shutdown(self) -> None:
        self.shut_down = True
        await super().shutdown()


def _engine() -> RecordingScriptedEngine:
    return RecordingScriptedEngine(ModelConfig(), ScriptedEngineConfig(), encode=lambda s: [ord(c) for c in s],
                                   decode=lambda ids: "".join(map(chr, ids)), decode_raw=lambda ids: "".join(map(chr, ids)))


async def test_an_engine_started_before_the_constructor_failed_is_shut_down():
    # The constructor got as far as starting the engine (a later step raised: no channel yet).
    replica = object.__new__(EngineReplica.func_or_class)
    replica.engine = _engine()
    await replica.engine.start()
    await replica.__del__()
    assert replica.engine.shut_down


async def test_a_replica_that_failed_before_its_engine_existed_stops_without_an_error():
    replica = object.__new__(EngineReplica.func_or_class)  # e.g. its tokenizer did not load
    await replica.__del__()
