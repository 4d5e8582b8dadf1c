"""`loopserve serve`'s config file and its failed starts, said in the operator's terms (no traceback)."""

from __future__ import annotations

import os

import pytest

from cluster.app import DeployFailed
from cluster.cli import ConfigUnusable, load_config, main


@pytest.fixture(autouse=True)
def environ_restored():
    """`main` sets what Ray's start needs (RAY_AUTH_MODE=token) in this process's environment: a Ray
    started later in the same test session then disagreed with its own client about token auth."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_serve_config_files_first_application_args_are_the_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("applications:\n  - name: x\n    args:\n      engine: {backend: scripted}\n")
    assert load_config(str(path)).engine.backend == "scripted"
    path.write_text("args:\n  model: {max_model_len: 4096}\n")  # loopserve's args alone
    assert load_config(str(path)).model.max_model_len == 4096
    assert load_config(None).engine.backend == "vllm"  # no file: the defaults


@pytest.mark.parametrize("text, said", [
    (None, "cannot read {path}: No such file or directory"),
    ("applications: [\n", "{path} is not YAML"),
    ("- just\n- a list\n", "{path} holds no mapping"),
    ("applications:\n  - args:\n      engine: {backend: gpu}\n",
     "{path}: 1 validation error for LoopserveConfig\nengine.backend"),
])
def test_a_config_file_it_cannot_use_is_named_with_the_reason(tmp_path, capsys, text, said):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigUnusable) as err:
        load_config(str(path))
    assert str(err.value).startswith(said.format(path=path)), err.value
    # the command says it on stderr and exits 2 before any cluster starts
    assert main(["serve", "--config", str(path)]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("loopserve serve: " + said.format(path=path)) and "Traceback" not in out.err


def test_a_failed_start_is_summed_up_by_each_replicas_own_exception():
    failed = DeployFailed("Deploying application loopserve failed: Failed to update the deployments ['EngineReplica'].",
                          {"EngineReplica (DEPLOY_FAILED)": "The deployment failed to start 1 times in a row.\n"
                                                            "Traceback (most recent call last):\n  File \"x.py\"\n"
                                                            "OSError: /models/m does not appear to have a file\n",
                           "ConnectionActor (UNHEALTHY)": ""})
    assert failed.summary() == ["EngineReplica (DEPLOY_FAILED): OSError: /models/m does not appear to have a file",
                                "ConnectionActor (UNHEALTHY): (no message)"]
    # the whole messages stay in the error itself (a benchmark's report, a log)
    assert "Traceback (most recent call last)" in str(failed) and str(failed).startswith("Deploying application")


def test_a_single_host_cluster_starts_with_rays_token_auth():
    from cluster.cli import ConfigUnusable, local_cluster_security

    env: dict = {}
    local_cluster_security(env)
    assert env["RAY_AUTH_MODE"] == "token"
    with pytest.raises(ConfigUnusable, match="RAY_AUTH_MODE=disabled"):
        local_cluster_security({"RAY_AUTH_MODE": "disabled"})
