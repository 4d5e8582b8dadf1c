"""Typed configuration: every `args` block of a serve config is validated here.

Each section lives in its own module, named for its key (`model.py` for `model:`, `engine.py`
for `engine:` with its backends' settings and KV budget, `deployments.py` for the replicas'
resources, ...); this module holds the top level and names every section, so
`from cluster.config import X` finds them all.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from cluster.config.auth import ApiKey, AuthConfig, KeysMissing
from cluster.config.base import TINY_MODEL_NAME, StrictModel
from cluster.config.cache import CacheConfig
from cluster.config.deployments import DeploymentResources
from cluster.config.engine import (AnswerRule, ChannelTlsConfig, EngineConfig, KvBudgetConfig, ScriptedEngineConfig,
                                   VLLMEngineConfig)
from cluster.config.limits import LimitsConfig
from cluster.config.mcp import McpConfig
from cluster.config.model import ImageInputConfig, ModelConfig
from cluster.config.ops import OpsConfig
from cluster.config.post_work import PostWorkConfig
from cluster.config.routing import RoutingConfig
from cluster.config.safety import GuardConfig, SafetyConfig
from cluster.config.sealing import SealingConfig
from cluster.config.store import StoreConfig
from cluster.config.telemetry import TelemetryConfig
from cluster.config.websocket import WebSocketConfig

__all__ = ["AnswerRule", "ApiKey", "AuthConfig", "CacheConfig", "ChannelTlsConfig",
           "DeploymentResources", "EngineConfig", "GuardConfig", "ImageInputConfig", "KeysMissing", "KvBudgetConfig", "LimitsConfig",
           "LoopserveConfig", "McpConfig", "ModelConfig", "OpsConfig", "PostWorkConfig", "RoutingConfig", "SafetyConfig",
           "ScriptedEngineConfig", "SealingConfig", "StoreConfig", "StrictModel", "TelemetryConfig", "TINY_MODEL_NAME",
           "VLLMEngineConfig", "WebSocketConfig"]


class LoopserveConfig(StrictModel):
    """Top-level application config (`args:` of the serve config)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    websocket: WebSocketConfig = Field(default_factory=WebSocketConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    post_work: PostWorkConfig = Field(default_factory=PostWorkConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    sealing: SealingConfig = Field(default_factory=SealingConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    mcp: McpConfig = Field(default_factory=McpConfig)
    ops: OpsConfig = Field(default_factory=OpsConfig)
    connection: DeploymentResources = Field(default_factory=DeploymentResources)
    """The connection replicas (HTTP and WebSocket ingress, the turn core, per-socket caches)."""
    render: DeploymentResources = Field(default_factory=DeploymentResources)
    """The render replicas (full renders: cache misses and stateless requests)."""
    engine_deployment: DeploymentResources = Field(
        default_factory=lambda: DeploymentResources(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=64)
    )
    """The engine replicas (one engine each)."""
    inline_delta_render: bool = True
    """Render delta jobs (anchor + new items, O(new)) in the connection actor itself: ~1 ms of work that would
    otherwise cost a handle hop. Full renders (O(history): cache misses, stateless requests) go to a
    RenderActor (or stay here: `render_in_connection`)."""
    serve_fast_path: bool = True
    """Ray Serve's low-latency request path for every deployment (see `cluster.ingress.modes.SERVE_FAST_PATH_ENV`)."""
    render_in_connection: bool = False
    """Full renders too run in the connection replica (in a worker thread), and no RenderActor deployment is
    started: one Ray worker process (and its copy of the tokenizer) fewer, for small one-machine deployments.
    Turn latency is the same either way (8 sessions on 2 cores, docs/benchmarks-history.md). Leave it off where full
    renders should scale apart from sockets (many nodes, stateless traffic). Needs `inline_delta_render` (its
    tokenizer renders)."""
    render_audit_every: int = Field(64, ge=0)
    """Every this many continuations rendered as deltas, one is rendered again in full after the turn (post-work,
    where full renders run) and compared with what the engine was sent; on a mismatch the connection replica renders
    every turn in full from then on, and so does every other connection replica of the app once it hears of it
    (through the `LimitsAndVerdicts`, deployed whenever there can be more than one). 0: off. Needs
    `inline_delta_render` (its tokenizer compares texts)."""
    template_analysis: bool = True
    """Read the chat template's AST at start-up and render in full the continuations whose exactness depends on
    message content (docs/behaviour.md, "Exact renders"). Off: only the start-up probe and the render audit decide
    (for a template the analysis refuses more of than it must)."""
    render_audit_first: int = Field(32, ge=0)
    """A replica's first this many continuations rendered as deltas are all checked so (a template's first
    sessions), before `render_audit_every` samples the rest."""
    verify_renders: bool = False
    """Verify every incremental render against a full render (tests; O(history))."""

    @model_validator(mode="after")
    def _render_home(self) -> "LoopserveConfig":
        if self.render_in_connection and not self.inline_delta_render:
            raise ValueError("render_in_connection needs inline_delta_render: the connection replica's tokenizer "
                             "is what renders")
        return self

    @property
    def shares_limits(self) -> bool:
        """`limits.shared_across_replicas`, resolved: None means whenever the connection deployment
        can run more than one replica."""
        if self.limits.shared_across_replicas is not None:
            return self.limits.shared_across_replicas
        conn = self.connection
        if conn.autoscaling_config is not None:
            return int(conn.autoscaling_config.get("max_replicas", 4)) > 1  # loopserve's default is 4
        return conn.num_replicas == "auto" or (conn.num_replicas or 1) > 1
