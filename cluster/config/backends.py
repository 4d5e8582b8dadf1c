"""Engine backends, each one record: the one place that names a backend.

Everything else asks the record (`backend_of(config.engine)`): which engine class a replica
starts, where its settings are, what it needs and does before serving, what it samples with. A
new backend is a folder under `cluster/engines/` (its `Engine` subclass) plus one `register` call
with its settings' class; its settings then come from `engine.options` in the config, validated by
that class. Data only: engine classes are named by import path and loaded where a replica starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from cluster.config.base import StrictModel

EngineConfig = Any  # cluster.config.engine.EngineConfig, which validates its backend against this registry


@dataclass(frozen=True)
class Backend:
    name: str
    engine_class: str
    """`module:Class` of its `Engine` (imported only where an engine replica starts)."""
    settings: Callable[[EngineConfig], Any]
    """Its settings from the engine section (its own section, or `engine.options` validated)."""
    default_max_tokens: Callable[[Any], int]
    """Output tokens a request that sets none gets, from its settings."""
    runs_weights: bool = False
    """It runs the model's weights: a generated model is built with them, a guard model needs a path."""
    warms_up: bool = False
    """One short generation before the replica serves (first-call costs off the first turn)."""
    model_sampling: bool = False
    """It samples with the model's generation_config.json defaults (what a response echoes)."""
    forces_tool_calls: Optional[bool] = None
    """Whether `tool_choice: required` can be forced; None: as the model family's tool format allows."""
    deployment_env: Callable[[EngineConfig], dict[str, str]] = lambda engine: {}
    """Environment its engine replicas start with."""
    gpus_per_replica: Callable[[EngineConfig], int] = lambda engine: 1
    """GPUs one replica spans (tensor parallelism: one placement bundle each)."""


BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


def backend_of(engine: EngineConfig) -> Backend:
    return BACKENDS[engine.backend]


def options_of(cls: type[StrictModel]) -> Callable[[EngineConfig], StrictModel]:
    """A registered backend's settings: `engine.options`, validated by its settings' class."""
    return lambda engine: cls.model_validate(engine.options)


def _vllm_env(engine: EngineConfig) -> dict[str, str]:
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(engine.vllm.cpu_kvcache_space_gib),
        # Not what its name suggests here: AsyncLLM always runs its engine core as a child process
        # (`VLLM::EngineCore`). In vLLM 0.32 it only steers the sync LLMEngine, the deterministic
        # external-launcher executor and a seed warning; kept as the engine has always been run.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


register(Backend(
    "vllm", "cluster.engines.vllm.engine:VLLMEngine", lambda engine: engine.vllm,
    lambda settings: settings.default_max_tokens, runs_weights=True, warms_up=True, model_sampling=True,
    deployment_env=_vllm_env, gpus_per_replica=lambda engine: engine.vllm.tensor_parallel_size))
register(Backend(
    "scripted", "cluster.engines.scripted.engine:ScriptedEngine", lambda engine: engine.scripted,
    lambda settings: settings.max_output_tokens, forces_tool_calls=True))
