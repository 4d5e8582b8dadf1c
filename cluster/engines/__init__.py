"""Engine backends behind `EngineReplica`, each in its own wing (`vllm/`, `scripted/`), and the
replica plumbing they share (the service, the stream, the direct channel, the KV budget in `kv/`).

Selected by `EngineConfig.backend` through its registry record (`cluster.config.backends`); the
replica gets the class injected (`engine_cls`), like Ray Serve LLM does.
"""

from __future__ import annotations

import importlib

from cluster.config import EngineConfig
from cluster.config.backends import backend_of
from cluster.engines.base import Engine, EngineDelta, EngineRequest


def engine_class(config: EngineConfig) -> type[Engine]:
    module, _, name = backend_of(config).engine_class.partition(":")
    return getattr(importlib.import_module(module), name)


__all__ = ["Engine", "EngineDelta", "EngineRequest", "engine_class"]
