"""The application builder: `serve run serve_configs/local.yaml` imports `build_app`."""

from __future__ import annotations

from typing import Any, Optional, Union

from ray.serve import Application

from .config import DeploymentResources, LoopserveConfig


def _options(res: DeploymentResources, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": res.num_cpus}
    if res.num_gpus:
        actor["num_gpus"] = res.num_gpus
    if env:
        actor["runtime_env"] = {"env_vars": env}
    return {
        "num_replicas": res.num_replicas,
        "max_ongoing_requests": res.max_ongoing_requests,
        "ray_actor_options": actor,
    }


def build_app(args: Union[LoopserveConfig, dict[str, Any], None] = None) -> Application:
    """Validate the config and bind ConnectionActor -> RenderActor, EngineReplica."""
    from actors.connection import ConnectionActor
    from actors.engine import EngineReplica
    from actors.render import RenderActor

    config = args if isinstance(args, LoopserveConfig) else LoopserveConfig.model_validate(args or {})
    engine_env = None
    if config.engine.backend == "vllm":
        engine_env = {
            "VLLM_CPU_KVCACHE_SPACE": str(config.engine.vllm.cpu_kvcache_space_gib),
            # Keep the engine core in the replica's process: faster start, one actor.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    render = RenderActor.options(**_options(config.render)).bind(config)
    engine = EngineReplica.options(
        health_check_timeout_s=120, **_options(config.engine_deployment, engine_env)
    ).bind(config)
    return ConnectionActor.options(**_options(config.connection)).bind(render, engine, config)
