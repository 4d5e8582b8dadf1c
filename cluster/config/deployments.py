"""Per-deployment resources, autoscaling and routing."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from cluster.config.base import StrictModel


class AutoscalingSettings(StrictModel):
    """Ray Serve autoscaling on ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0)
    """Fewest replicas."""
    max_replicas: int = Field(4, ge=1)
    """Most replicas."""
    target_ongoing_requests: float = Field(8.0, gt=0)
    """Ongoing requests per replica Serve aims for."""
    upscale_delay_s: float = 10.0
    """How long demand must stay high before a replica is added."""
    downscale_delay_s: float = 300.0
    """How long demand must stay low before a replica is removed."""


class DeploymentResources(StrictModel):
    """A deployment's replicas and their resources (Ray Serve deployment options)."""

    num_replicas: int = Field(1, ge=1)
    """Replicas of the deployment (unless `autoscaling` is set)."""
    num_cpus: float = 0.25
    """CPUs Ray reserves for each replica."""
    num_gpus: float = 0.0
    """GPUs Ray reserves for each replica."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources, to place deployments on node groups (e.g. engines on GPU workers:
    `{"loopserve_engine": 1}` with the node started with it)."""
    max_ongoing_requests: int = 256
    """Requests (a WebSocket counts for its whole life) one replica takes at once; more wait in Serve."""
    autoscaling: Optional[AutoscalingSettings] = None
    """When set, replaces num_replicas."""
    graceful_shutdown_timeout_s: float = Field(60.0, gt=0)
    """Scale-down/redeploy: how long a stopping replica may finish its work (connection replicas: the turns in
    flight on their sockets) before it is killed."""
    serve_options: dict[str, Any] = Field(default_factory=dict)
    """Any other Ray Serve deployment option, passed to Serve as it is (`max_queued_requests`,
    `health_check_period_s`, `max_replicas_per_node`, `logging_config`, ...: the arguments of
    `@serve.deployment`). Dict-valued options are merged into what loopserve sets (`ray_actor_options`,
    `autoscaling_config`); the others replace it."""

    @field_validator("serve_options")
    @classmethod
    def _known_to_serve(cls, options: dict[str, Any]) -> dict[str, Any]:
        import inspect

        from ray import serve

        known = set(inspect.signature(serve.deployment).parameters) - {"_func_or_class", "name", "version"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"not Ray Serve deployment options: {unknown}; known: {sorted(known)}")
        return options


class RoutingConfig(StrictModel):
    """How engine requests find a replica.

    `session_affinity`: Ray Serve's ConsistentHashRouter on the session key, so
    every turn of a session reaches the replica holding its prefix KV; when that
    replica dies the session moves (next turn = full prefill there).
    """

    policy: Literal["session_affinity", "least_loaded"] = "session_affinity"
    """`session_affinity` (consistent hash on the session key) or `least_loaded` (Serve's default router)."""
    num_virtual_nodes: int = Field(100, ge=1)
    """Points per replica on the consistent-hash ring."""
    num_fallback_replicas: int = Field(1, ge=0)
    """Successors tried when the session's replica rejects under backpressure."""
    engine_retries: int = Field(5, ge=0)
    """Retries of an engine call that failed before its first chunk (replica died). backoff 0.5 s, 1 s, ...: ~7.5 s
    covers a replica restart."""
