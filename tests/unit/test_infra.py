"""Deployment manifests validate: KubeRay RayService, serve configs, collector config, dashboard, image."""

import json
import re
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import LoopserveConfig, TelemetryConfig
from cluster.ingress.modes import HAPROXY_BINARY_ENV, LAUNCHER, ingress_env

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def rayservice() -> dict:
    return yaml.safe_load((INFRA / "k8s" / "rayservice.yaml").read_text())


def test_rayservice_shape():
    rs = rayservice()
    assert rs["apiVersion"] == "ray.io/v1" and rs["kind"] == "RayService"
    cluster = rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replicas on the head
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"cpu-workers", "gpu-workers"}
    for g in groups.values():
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        (container,) = g["template"]["spec"]["containers"]
        assert container["image"] and container["resources"]["limits"]["cpu"]
    gpu = groups["gpu-workers"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == "1"
    # Every Ray container runs loopserve's ingress mode: Serve's fast request path and HAProxy,
    # through loopserve-haproxy (the image installs it in /usr/local/bin).
    for c in [head["template"]["spec"]["containers"][0]] + [g["template"]["spec"]["containers"][0] for g in groups.values()]:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {k: env[k] for k in ingress_env("haproxy")} == ingress_env("haproxy")
        assert env[HAPROXY_BINARY_ENV] == "/usr/local/bin/" + LAUNCHER


def _group_resources(group: dict) -> dict:
    raw = group["rayStartParams"].get("resources", "{}")
    return json.loads(json.loads(raw) if raw.startswith('"') else raw)


def test_rayservice_serve_config_loads_with_ray_and_our_schema():
    rs = rayservice()
    serve_config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)  # Ray Serve's own schema
    (app,) = serve_config["applications"]
    assert app["import_path"] == "cluster.app:build_app"
    config = LoopserveConfig.model_validate(app["args"])  # ours (extra=forbid: typos fail)
    groups = {g["groupName"]: _group_resources(g) for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    # Every custom resource a deployment asks for is offered by a worker group.
    for res in (config.connection, config.render, config.safety.deployment, config.engine_deployment):
        for name in res.resources:
            assert any(name in offered for offered in groups.values()), name
        assert res.autoscaling_config is not None and res.autoscaling_config["min_replicas"] >= 1
    assert "loopserve_gpu_node" in config.engine_deployment.resources and config.engine_deployment.num_gpus == 1
    assert config.telemetry.enabled and config.telemetry.endpoint.endswith(":4317")


@pytest.mark.parametrize("path", sorted((ROOT / "serve_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_serve_configs_load_with_ray_schema(path):
    serve_config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(serve_config)
    for app in serve_config["applications"]:
        LoopserveConfig.model_validate(app.get("args") or {})


def test_collector_config_pipelines_are_wired():
    col = yaml.safe_load((INFRA / "otel-collector.yaml").read_text())
    for name, pipeline in col["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in col[kind], (name, kind, component)
    assert set(col["service"]["pipelines"]) == {"traces", "metrics"}
    protocols = col["receivers"]["otlp"]["protocols"]
    # Our default exporter (OTLP/gRPC on 4317) and the HTTP one (4318) both land.
    assert protocols["grpc"]["endpoint"].endswith(TelemetryConfig().endpoint.rsplit(":", 1)[1])
    assert protocols["http"]["endpoint"].endswith(":4318")


def _prometheus_names() -> set[str]:
    """Our instruments, named as the collector's Prometheus exporter exposes them."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from cluster import telemetry
    from cluster.engines.kv.budget import KV_METRICS

    reader = InMemoryMetricReader()
    m = telemetry.Metrics(MeterProvider(metric_readers=[reader]).get_meter("t"))
    for inst in (m.turns, m.output_tokens, m.cache_lookups, m.safety_blocks, m.connections):
        inst.add(1)
    for inst in (m.overhead, m.ttft, m.decode_rate, m.store_write):
        inst.record(1.0)
    m.observe("loopserve.session_cache.bytes", lambda: [(1, {})], unit="By")
    m.observe("loopserve.engine.queue_depth", lambda: [(1, {})])
    for name in KV_METRICS:
        m.observe(name, lambda: [(1, {})])
    units = {"ms": "_milliseconds", "By": "_bytes", "1/s": "_per_second", "": ""}
    names = set()
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                base = metric.name.replace(".", "_")
                suffix = units[metric.unit or ""]
                if not base.endswith(suffix):
                    base += suffix
                kind = type(metric.data).__name__
                if kind == "Histogram":
                    names |= {base + "_bucket", base + "_sum", base + "_count"}
                elif kind == "Sum" and metric.data.is_monotonic:
                    names.add(base + "_total")
                else:
                    names.add(base)
    return names


def test_dashboard_queries_only_metrics_we_export():
    dash = json.loads((INFRA / "grafana" / "loopserve-dashboard.json").read_text())
    exported = _prometheus_names()
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"loopserve_[a-z_]+", target["expr"]))
    assert used and used <= exported, used - exported
    # and every metric family we export has a panel
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    assert families == {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}


def test_image_definition_matches_the_project():
    text = (INFRA / "Dockerfile").read_text()
    for path in re.findall(r"^COPY (\S+) ", text, re.M):
        if path != "pyproject.toml":
            assert (ROOT / path).exists(), path
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert (ROOT / cmd[cmd.index("--config") + 1]).exists()
    for key, value in ingress_env("haproxy").items():
        assert f"{key}={value}" in text
    assert cmd[:2] == ["loopserve", "serve"]  # which applies the same mode when it starts Ray
    assert f"{HAPROXY_BINARY_ENV}=/usr/local/bin/{LAUNCHER}" in text


# -- safe as written ------------------------------------------------------------------------


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost")


def _serve_configs() -> list[tuple[str, dict]]:
    found = [(p.name, yaml.safe_load(p.read_text())) for p in sorted((ROOT / "serve_configs").glob("*.yaml"))]
    return found + [("rayservice", yaml.safe_load(rayservice()["spec"]["serveConfigV2"]))]


@pytest.mark.parametrize("name,serve_config", _serve_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_config_bound_beyond_loopback_requires_api_keys(name, serve_config):
    host = (serve_config.get("http_options") or {}).get("host", "0.0.0.0")  # Serve's HAProxy default
    for app in serve_config["applications"]:
        auth = LoopserveConfig.model_validate(app.get("args") or {}).auth
        if not _loopback(host):
            assert auth.require_keys and (auth.keys or auth.keys_file), (name, app["name"])


def test_a_required_key_that_is_missing_refuses_the_start_with_how_to_fix_it(tmp_path):
    from cluster.config import AuthConfig, KeysMissing

    with pytest.raises(KeysMissing, match="auth.keys_file"):
        AuthConfig(require_keys=True, keys_file=str(tmp_path / "absent.yaml")).resolved()
    with pytest.raises(KeysMissing, match="key_sha256"):
        AuthConfig(require_keys=True).resolved()
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"sha256": "ab" * 32, "tenant": "t"}], "admin_keys": ["cd" * 32]}))
    resolved = AuthConfig(require_keys=True, keys_file=str(keys)).resolved()
    assert [k.tenant for k in resolved.keys] == ["t"] and resolved.admin_keys == ["cd" * 32]


def test_admin_keys_in_clear_are_refused_in_the_config_and_in_the_keys_file(tmp_path):
    from pydantic import ValidationError

    from cluster.config import AuthConfig

    with pytest.raises(ValidationError, match="never keys in clear"):
        AuthConfig(admin_keys=["sk-admin-in-clear"])
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"admin_keys": ["sk-admin-in-clear"]}))
    with pytest.raises(ValidationError, match="never keys in clear"):
        AuthConfig(keys_file=str(keys)).resolved()


def test_the_cli_refuses_to_bind_beyond_loopback_without_keys(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cluster", "serve", "--host", "0.0.0.0", "--config",
                          str(ROOT / "serve_configs/scripted.yaml")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "API keys are required" in out.stderr and "--host 127.0.0.1" in out.stderr


def test_the_rayservice_keeps_secrets_in_secrets_and_runs_unprivileged():
    rs = rayservice()
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "postgres_dsn" not in args["store"] and args["store"]["postgres_dsn_env"] == "LOOPSERVE_POSTGRES_DSN"
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "loopserve"  # the NetworkPolicy's selector
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["spec"]["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        env = {e["name"]: e for e in container["env"]}
        assert env["LOOPSERVE_POSTGRES_DSN"]["valueFrom"]["secretKeyRef"]["name"] == "loopserve-postgres"
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(Path(args["auth"]["keys_file"]).parent) in mounts
        assert str(Path(args["engine"]["channel_tls"]["ca_file"]).parent) in mounts  # channel TLS across nodes
    text = (INFRA / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")


def test_the_network_policy_admits_the_api_and_keeps_ray_and_the_dashboard_inside():
    policy = yaml.safe_load((INFRA / "k8s" / "networkpolicy.yaml").read_text())
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "loopserve"}
    open_to_all = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert [p["port"] for r in open_to_all for p in r["ports"]] == [8000]  # the API only
    dashboard = [r for r in policy["spec"]["ingress"] if any(p["port"] == 8265 for p in r.get("ports", []))]
    assert len(dashboard) == 1 and all("namespaceSelector" in f for f in dashboard[0]["from"])
    for rule in policy["spec"]["ingress"]:
        if "from" in rule and "ports" not in rule:  # Ray's ports: this cluster's pods only
            assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "loopserve"}}}]
