"""The application builder: `serve run serve_configs/local.yaml` imports `build_app`."""

from __future__ import annotations

import logging
import secrets
from typing import Any, Optional, Union
from urllib.parse import urlsplit

from ray.serve import Application

from cluster.config import DeploymentResources, LoopserveConfig
from cluster.config.backends import backend_of
from cluster.ingress.modes import SERVE_FAST_PATH_ENV, haproxy_ingress
from cluster.torch_extras import startup_env

CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
KV_PLACEMENT_ROUTER = "cluster.serve_plugins.kv_router.KvPlacementRouter"

# Replicas tokenize one text at a time (a turn's new items, an output to decode): `tokenizers`
# would hand each to its rayon pool and wait (2 KB: 0.53 -> 0.45 ms in-thread here), and the pool's
# threads would wake on the cores a CPU engine's kernels are using.
PROCESS_ENV = {"TOKENIZERS_PARALLELISM": "false"}


def _options(res: DeploymentResources, env: Optional[dict[str, str]] = None, fast_path: bool = True) -> dict[str, Any]:
    """A deployment's options: the config's Serve options as they are, plus the environment
    loopserve's processes need (under the operator's own `runtime_env.env_vars`)."""
    opts = res.serve_options()
    env = {**PROCESS_ENV, **(SERVE_FAST_PATH_ENV if fast_path else {}), **(env or {})}
    if env:
        actor = opts["ray_actor_options"]
        runtime_env = actor.setdefault("runtime_env", {})
        runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
    opts.setdefault("graceful_shutdown_wait_loop_s", 0.5)
    return opts


def engine_options(config: LoopserveConfig) -> dict[str, Any]:
    """Engine deployment options: resources, session-affine router, TP placement."""
    backend = backend_of(config.engine)
    # The torch-extension guard in this process and the ones a backend running weights starts; no
    # OMP_NUM_THREADS: a CPU engine's kernel threads follow its core binding (VLLMEngine.start).
    env = {**startup_env(), **backend.deployment_env(config.engine)} if backend.runs_weights else \
        (backend.deployment_env(config.engine) or None)
    opts = _options(config.engine_deployment, env, config.serve_fast_path)
    opts["health_check_timeout_s"] = 120
    if config.engine.direct_stream and "autoscaling_config" in opts:
        # Most turns bypass Serve's request count: scale on what the engines report.
        opts["autoscaling_config"]["policy"] = {"policy_function": "cluster.serve_plugins.autoscaling:engine_in_flight_policy"}
    routing = config.routing
    if routing.policy == "session_affinity":
        from ray.serve.config import RequestRouterConfig

        # New sessions go to the replica with the most KV headroom (reported through Serve's
        # routing stats), then stay there: cluster/serve_plugins/kv_router.py. Without a KV
        # budget there are no stats, and the router is the ring plus the chain's named replica:
        # Serve's own ring would hash `key@replica` and scatter a chain continued from another
        # connection replica (a re-prefill each time).
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=KV_PLACEMENT_ROUTER,
            request_router_kwargs={
                "num_virtual_nodes": routing.num_virtual_nodes,
                "num_fallback_replicas": routing.num_fallback_replicas,
            },
            request_routing_stats_period_s=1.0,
            request_routing_stats_timeout_s=5.0,
        )
    tp = backend.gpus_per_replica(config.engine)
    res = config.engine_deployment
    if tp > 1 and res.num_gpus:
        # One bundle per TP worker on one node; vLLM's Ray executor fills them.
        actor = opts["ray_actor_options"]
        opts["placement_group_bundles"] = [{"CPU": res.num_cpus, "GPU": 1}] + [{"GPU": 1}] * (tp - 1)
        opts["placement_group_strategy"] = "STRICT_PACK"
        actor.pop("num_gpus", None)
        actor["num_cpus"] = 0
    return opts


def connection_options(config: LoopserveConfig) -> dict[str, Any]:
    """Ingress deployment options: resources, and sticky routing of `x-session-id` at the proxy."""
    opts = _options(config.connection, fast_path=config.serve_fast_path)
    if config.routing.policy == "session_affinity" and not haproxy_ingress():
        from ray.serve.config import RequestRouterConfig

        # The proxy routes by `x-session-id` (HTTP and WebSocket upgrades), so an
        # HTTP continuation reaches the replica holding the session in memory.
        # (Under HAProxy, Serve refuses a custom router on the ingress: HAProxy
        # balances connections itself; HTTP continuations that land elsewhere
        # load their chain from the store. Engine calls stay sticky.)
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=CONSISTENT_HASH_ROUTER,
            request_router_kwargs={"num_virtual_nodes": config.routing.num_virtual_nodes,
                                   "num_fallback_replicas": config.routing.num_fallback_replicas},
        )
    return opts


log = logging.getLogger("loopserve")


def inline_secrets(config: LoopserveConfig) -> list[str]:
    """Secrets written into the config itself: Serve keeps the deployed config, and `serve config`
    and the dashboard (`/api/serve/applications/`) show it to whoever can reach them."""
    found = []
    if config.sealing.keys:
        found.append("sealing.keys (use sealing.keys_file)")
    if config.auth.keys or config.auth.admin_keys:
        found.append("auth.keys / auth.admin_keys (unsalted sha256 digests: a weak key can be recovered from "
                     "its digest; use auth.keys_file)")
    if config.store.backend == "postgres" and not config.store.postgres_dsn_env \
            and urlsplit(config.store.postgres_dsn).password:
        found.append("store.postgres_dsn with a password (use store.postgres_dsn_env)")
    return found


def with_sealing_key(config: LoopserveConfig) -> LoopserveConfig:
    """`config` with a sealing key of this deployment's own when it configures none: every replica
    is bound with the same config, so blobs open on any of them, and stop opening after a redeploy
    (docs/configuration.md, `sealing`)."""
    if config.sealing.keys or config.sealing.keys_file:
        return config
    from cluster.protocol.sealing import new_key

    key_id = f"deploy-{secrets.token_hex(4)}"
    return config.model_copy(update={"sealing": config.sealing.model_copy(
        update={"keys": {key_id: new_key()}, "active": key_id})})


def build_app(args: Union[LoopserveConfig, dict[str, Any], None] = None) -> Application:
    """Validate the config and bind ConnectionActor -> RenderActor (unless `render_in_connection`), EngineReplica
    (+ SafetyActor, GuardEngine when safety runs out of line; + LimitsAndVerdicts when keys' limits are shared)."""
    from actors.connection import ConnectionActor
    from actors.engine import EngineReplica
    from actors.render import RenderActor
    from actors.safety import SafetyActor

    config = args if isinstance(args, LoopserveConfig) else LoopserveConfig.model_validate(args or {})
    if not config.model.path:
        from cluster.models.builtin import check_can_make

        check_can_make(config.model.builtin)  # a missing package fails here, not in every replica
    for secret in inline_secrets(config):
        log.warning("the config holds a secret inline, which Serve shows in its deployed config: %s", secret)
    if not (config.sealing.keys or config.sealing.keys_file):
        log.info("no sealing key configured: this deployment makes its own, so blobs handed out before a redeploy "
                 "or config update no longer open after it (set sealing.keys_file to keep them)")
    config = with_sealing_key(config)
    fast = config.serve_fast_path
    render = None
    if not config.render_in_connection:
        render = RenderActor.options(**_options(config.render, fast_path=fast)).bind(config)
    engine = EngineReplica.options(**engine_options(config)).bind(config)
    safety = None
    if config.safety.enabled and not config.safety.runs_inline:
        guard = None
        if config.safety.classifier == "guard":
            g = config.safety.guard
            guard_config = LoopserveConfig(model=g.model, engine=g.engine, engine_deployment=g.deployment,
                                           routing={"policy": "least_loaded"}, safety={"enabled": False})
            guard = EngineReplica.options(name="GuardEngine", **engine_options(guard_config)).bind(guard_config)
        safety = SafetyActor.options(**_options(config.safety.deployment, fast_path=fast)).bind(config, guard)
    ledger = None
    if config.shares_limits:
        from actors.limits import LimitsAndVerdicts

        ledger = LimitsAndVerdicts.bind()
    conn_opts = connection_options(config)
    return ConnectionActor.options(**conn_opts).bind(render, engine, config, safety, ledger)


class DeployFailed(RuntimeError):
    """A loopserve app that did not start. Serve's own error names the failed deployments only
    (their replicas' errors are in the cluster's logs, which go with a local cluster's temporary
    directory): this one carries each failed deployment's status message, the replica's error in it."""

    def __init__(self, serve_error: str, failures: dict[str, str]) -> None:
        self.failures = failures  # "Deployment (STATUS)" -> Serve's status message
        super().__init__("\n".join([serve_error, *(f"{dep}: {msg}" for dep, msg in failures.items())]))

    def summary(self) -> list[str]:
        """A line per failed deployment: its replica's exception (the last line of a traceback)."""
        lines = []
        for dep, msg in self.failures.items():
            last = [line.strip() for line in msg.splitlines() if line.strip()]
            lines.append(f"{dep}: {last[-1] if last else '(no message)'}")
        return lines


def deployment_failures(app: str) -> dict[str, str]:
    """Serve's status message of every deployment of `app` that is not healthy (a replica's start error)."""
    from ray import serve

    try:
        status = serve.status().applications.get(app)
    except Exception as exc:  # noqa: BLE001 - a report on the way to an error, never a new one
        return {"(Serve's status)": str(exc)}
    if status is None:
        return {f"(no application {app!r} in Serve's status)": ""}
    failed = {f"{dep} ({getattr(d.status, 'value', d.status)})": d.message
              for dep, d in status.deployments.items() if d.status != "HEALTHY"}
    return failed or {"(application)": status.message}


def run_app(args: Union[LoopserveConfig, dict[str, Any], None], name: str, route_prefix: str) -> None:
    """`serve.run` of a loopserve app, not blocking; raises `DeployFailed` if it does not start."""
    from ray import serve

    try:
        serve.run(build_app(args), name=name, route_prefix=route_prefix, blocking=False)
    except RuntimeError as exc:
        raise DeployFailed(str(exc), deployment_failures(name)) from exc
