"""Engine backends behind `EngineReplica`: vLLM's AsyncLLM and a scripted engine.

Selected by `EngineConfig.backend`; the replica gets the class injected
(`engine_cls`), like Ray Serve LLM does.
"""

from __future__ import annotations

from cluster.config import EngineConfig
from cluster.engines.base import Engine, EngineDelta, EngineRequest


def engine_class(config: EngineConfig) -> type[Engine]:
    if config.backend == "scripted":
        from cluster.engines.scripted.engine import ScriptedEngine

        return ScriptedEngine
    from cluster.engines.vllm.engine import VLLMEngine

    return VLLMEngine


__all__ = ["Engine", "EngineDelta", "EngineRequest", "engine_class"]
