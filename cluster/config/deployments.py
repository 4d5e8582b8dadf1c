"""`connection`, `render`, `engine_deployment` (and the guard's and safety actors' `deployment`):
each deployment's resources and autoscaling."""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationError, model_validator

from cluster.config.base import StrictModel

log = logging.getLogger("loopserve.config")


DEFAULT_NUM_CPUS = 0.25  # what a replica reserves unless `ray_actor_options` says
# loopserve's own defaults under an `autoscaling_config` (Serve's would upscale a connection
# deployment at 2 open WebSockets per replica and wait 30 s to do it).
AUTOSCALING_DEFAULTS: dict[str, Any] = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0,
                                        "upscale_delay_s": 10.0, "downscale_delay_s": 300.0}
# What loopserve spelled differently before the options passed through (still read, with a warning).
_OLD_SPELLINGS = {"num_cpus": "ray_actor_options.num_cpus", "num_gpus": "ray_actor_options.num_gpus",
                  "resources": "ray_actor_options.resources", "autoscaling": "autoscaling_config",
                  "serve_options": "the option's own name at this level"}


def _serve_fields() -> tuple[set[str], set[str], set[str]]:
    """The names Serve's own schemas know: deployment options, actor options, autoscaling."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema, RayActorOptionsSchema

    return (set(DeploymentSchema.model_fields) - {"name"}, set(RayActorOptionsSchema.model_fields),
            set(AutoscalingConfig.model_fields))


class DeploymentResources(StrictModel):
    """A deployment's Ray Serve options: the arguments of `@serve.deployment` under Serve's own
    names (`num_replicas`, `ray_actor_options`, `max_ongoing_requests`, `autoscaling_config`,
    `graceful_shutdown_timeout_s`, `max_queued_requests`, `health_check_period_s`,
    `max_replicas_per_node`, `logging_config`, ...), passed to Serve as they are and checked by
    Serve's own schemas at start (an unknown name is refused, with the known ones). The fields
    below are the ones loopserve gives its own defaults."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    num_replicas: Optional[Union[int, Literal["auto"]]] = None
    """Replicas of the deployment; 1 when neither this nor `autoscaling_config` is set. `auto`: autoscaling
    with loopserve's defaults (the same as `autoscaling_config: {}`)."""
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    """Ray's resources for each replica (`num_cpus`, `num_gpus`, `memory`, `resources`: custom Ray resources to
    place deployments on node groups, e.g. `{"loopserve_engine": 1}` with the node started with it;
    `runtime_env`). `num_cpus` is 0.25 unless given."""
    max_ongoing_requests: int = 256
    """Requests (a WebSocket counts for its whole life) one replica takes at once; more wait in Serve."""
    autoscaling_config: Optional[dict[str, Any]] = None
    """Serve's autoscaling (`min_replicas`, `max_replicas`, `target_ongoing_requests`, `upscale_delay_s`,
    `downscale_delay_s`, ...); what is not given is loopserve's default: 1-4 replicas, 8 ongoing requests
    per replica, 10 s up, 300 s down. Replaces `num_replicas`."""
    graceful_shutdown_timeout_s: float = Field(60.0, gt=0)
    """Scale-down/redeploy: how long a stopping replica may finish its work (connection replicas: the turns in
    flight on their sockets) before it is killed."""
    max_constructor_retry_count: Optional[int] = Field(None, gt=0)
    """Replica starts that may fail (an error in its constructor) before the deployment is DEPLOY_FAILED; Serve
    stops at the smaller of this (its default 20) and 3 per target replica. A `@serve.deployment` option that
    Serve's config-file schema does not list, so it is named here."""

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        old = sorted(set(data) & set(_OLD_SPELLINGS)) if isinstance(data, dict) else []
        if not old:
            return data
        data = dict(data)
        log.warning("deployment options %s: loopserve's old spelling, read as %s (Serve's own names)",
                    old, ", ".join(_OLD_SPELLINGS[k] for k in old))
        actor = dict(data.get("ray_actor_options") or {})
        for key in ("num_cpus", "num_gpus", "resources"):
            if key in data:
                actor.setdefault(key, data.pop(key))
        if actor:
            data["ray_actor_options"] = actor
        if "autoscaling" in data:
            data.setdefault("autoscaling_config", data.pop("autoscaling"))
        for key, value in (data.pop("serve_options", None) or {}).items():
            mine = data.get(key)
            data[key] = {**mine, **value} if isinstance(mine, dict) and isinstance(value, dict) else value
        return data

    @model_validator(mode="after")
    def _checked_by_serve(self) -> "DeploymentResources":
        from ray.serve.config import AutoscalingConfig
        from ray.serve.schema import DeploymentSchema

        known, actor_known, autoscaling_known = _serve_fields()
        for what, given, names in (("Ray Serve deployment options", self.model_extra or {}, known),
                                   ("Ray actor options", self.ray_actor_options, actor_known),
                                   ("Serve autoscaling options", self.autoscaling_config or {}, autoscaling_known)):
            unknown = sorted(set(given) - names)
            if unknown:
                raise ValueError(f"not {what}: {unknown}; known: {sorted(names)}")
        self.ray_actor_options = {"num_cpus": DEFAULT_NUM_CPUS, **self.ray_actor_options}
        if self.num_replicas == "auto":
            # Serve would read "auto" as its own defaults (1-100 replicas, 2 ongoing requests each);
            # as an autoscaling_config it gets loopserve's, and engines their in-flight policy.
            self.num_replicas = None
            self.autoscaling_config = self.autoscaling_config or {}
        if self.autoscaling_config is not None:
            if self.num_replicas is not None:
                raise ValueError("num_replicas and autoscaling_config both set: autoscaling_config replaces it")
            self.autoscaling_config = {**AUTOSCALING_DEFAULTS, **self.autoscaling_config}
            AutoscalingConfig(**self.autoscaling_config)
        checked = {k: v for k, v in self.serve_options().items() if k != "max_constructor_retry_count"}
        try:
            DeploymentSchema(name="check", **checked)
        except ValidationError as exc:
            raise ValueError(f"Ray Serve refuses these deployment options: {exc}") from None
        return self

    def serve_options(self) -> dict[str, Any]:
        """The options for `@serve.deployment` (a fresh copy: callers add to it)."""
        opts = copy.deepcopy(self.model_dump(exclude_none=True))
        if self.autoscaling_config is None and self.num_replicas is None:
            opts["num_replicas"] = 1
        return opts

    @property
    def num_cpus(self) -> float:
        return float(self.ray_actor_options["num_cpus"])  # set by the validator

    @property
    def num_gpus(self) -> float:
        return float(self.ray_actor_options.get("num_gpus") or 0)

    @property
    def resources(self) -> dict[str, float]:
        return dict(self.ray_actor_options.get("resources") or {})

    @property
    def max_replicas(self) -> int:
        """The most replicas this deployment can have."""
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config["max_replicas"])
        return self.num_replicas or 1
