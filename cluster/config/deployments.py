"""Per-deployment resources, autoscaling and routing."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from cluster.config.base import StrictModel


class AutoscalingSettings(StrictModel):
    """Ray Serve autoscaling on ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 300.0


class DeploymentResources(StrictModel):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = 0.25
    num_gpus: float = 0.0
    # Custom Ray resources, to place deployments on node groups (e.g. engines on
    # GPU workers: `{"loopserve_engine": 1}` with the node started with it).
    resources: dict[str, float] = Field(default_factory=dict)
    max_ongoing_requests: int = 256
    # When set, replaces num_replicas.
    autoscaling: Optional[AutoscalingSettings] = None
    # Scale-down/redeploy: how long a stopping replica may finish its work
    # (connection replicas: the turns in flight on their sockets) before it is killed.
    graceful_shutdown_timeout_s: float = Field(60.0, gt=0)


class RoutingConfig(StrictModel):
    """How engine requests find a replica.

    `session_affinity`: Ray Serve's ConsistentHashRouter on the session key, so
    every turn of a session reaches the replica holding its prefix KV; when that
    replica dies the session moves (next turn = full prefill there).
    """

    policy: Literal["session_affinity", "least_loaded"] = "session_affinity"
    num_virtual_nodes: int = Field(100, ge=1)
    # Successors tried when the session's replica rejects under backpressure.
    num_fallback_replicas: int = Field(1, ge=0)
    # Retries of an engine call that failed before its first chunk (replica died).
    engine_retries: int = Field(5, ge=0)  # backoff 0.5 s, 1 s, ...: ~7.5 s covers a replica restart
