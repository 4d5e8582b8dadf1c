"""`safety`: input and output classification, and the guard model's own engine."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from cluster.config.backends import backend_of
from cluster.config.base import StrictModel
from cluster.config.deployments import DeploymentResources
from cluster.config.engine import EngineConfig
from cluster.config.model import ModelConfig


class GuardConfig(StrictModel):
    """A Llama Guard-style model served by its own engine deployment."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The guard model's own engine."""
    deployment: DeploymentResources = Field(default_factory=lambda: DeploymentResources(ray_actor_options={"num_cpus": 0.5}))
    """The guard engine's replicas."""
    max_tokens: int = 10
    """Output tokens the guard model may use for a verdict."""
    on_unparseable: Literal["flag", "allow"] = "flag"
    """A guard answer that is neither `safe` nor `unsafe ...` (a wrong model, a truncated answer) is logged and
    counted; this decides the verdict."""


class SafetyConfig(StrictModel):
    """Input/output classification by the SafetyActor.

    `default`: the scikit-learn profanity model shipped in `alt-profanity-check`
    plus the `policy` patterns; `policy`: the patterns only; `guard`: a Llama
    Guard-style model on the engine tier (plus the patterns).
    """

    enabled: bool = True
    """Classify input before it reaches the model and output before it reaches the client."""
    classifier: Literal["default", "policy", "guard"] = "default"
    """`default` (profanity model + policy patterns), `policy` (patterns only) or `guard` (a guard model)."""
    profanity_threshold: float = Field(0.9, ge=0, le=1)
    """The profanity model's score at which a text is flagged."""
    policy: dict[str, list[str]] = Field(default_factory=dict)
    """Category -> regular expressions (case-insensitive); a match flags the text."""
    classify_tool_outputs: bool = False
    """Tool outputs are the client's own data (files, command output): not classified unless asked, to keep false
    positives out of agent loops. Applies to a remote MCP server's answers too (classified before the model's next
    output goes out; a flagged one ends the response with `content_filter`)."""
    output_chunk_chars: int = Field(256, ge=16)
    """Generated text is classified in chunks of this many characters, before the client sees them."""
    max_unverified_chars: Optional[int] = Field(None, ge=16)
    """The most generated characters a client may hold before the classifier's verdict on them (a flagged answer
    is cut within this many characters of the flagged chunk's start, however large the engine's pieces and however
    late the verdicts). Default: two chunks; never below one chunk."""
    guard: GuardConfig = Field(default_factory=GuardConfig)
    placement: Literal["inline", "actor"] = "inline"
    """Where the `default`/`policy` classifiers run: `inline` in the connection replica (~0.1 ms a check; no handle
    hop before the first token) or `actor` (the SafetyActor deployment, scaled on its own). A `guard` always
    runs as an actor."""
    deployment: DeploymentResources = Field(default_factory=lambda: DeploymentResources(ray_actor_options={"num_cpus": 0.1}))
    """The SafetyActor replicas (with `placement: actor`, or a guard)."""

    @property
    def runs_inline(self) -> bool:
        return self.enabled and self.placement == "inline" and self.classifier != "guard"

    @model_validator(mode="after")
    def _guard_has_a_model(self) -> "SafetyConfig":
        g = self.guard
        if self.enabled and self.classifier == "guard" and backend_of(g.engine).runs_weights and g.model.path is None:
            raise ValueError("safety.classifier 'guard' needs safety.guard.model.path (a Llama Guard-style "
                             "model); the generated tiny model has random weights and cannot judge anything")
        return self

