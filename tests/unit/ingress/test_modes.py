"""The environment a one-machine Ray cluster starts with (cluster/ingress/modes.py): Ray reads every
setting, and what the user exported wins."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ray

from cluster.ingress.modes import HAPROXY_ENV, LOCAL_CLUSTER_ENV, SERVE_FAST_PATH_ENV, apply_ingress_env

# Ray's core settings (`RAY_<name>`, ray_config_def.h); an unknown name is ignored without a word.
CORE = {k: v for k, v in LOCAL_CLUSTER_ENV.items() if k.startswith("RAY_") and k[4:].islower()}


def test_every_core_setting_names_a_field_of_this_rays_config():
    # A renamed field in a Ray upgrade would silently bring the housekeeping wakeups back.
    binary = (Path(ray.__file__).parent / "_raylet.so").read_bytes()
    missing = [k for k in CORE if b"\0" + k[4:].encode() + b"\0" not in binary]
    assert CORE and not missing, missing


def test_serve_and_log_monitor_read_the_python_settings():
    code = ("import json; from ray.serve._private import constants as c; from ray._private import log_monitor as m; "
            "print(json.dumps([c.CONTROL_LOOP_INTERVAL_S, c.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS, "
            "m.RAY_LOG_MONITOR_MANY_FILES_THRESHOLD, m.LOG_NAME_UPDATE_INTERVAL_S]))")
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_CLUSTER_ENV}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **LOCAL_CLUSTER_ENV}, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [0.5, 1000, 0, 5.0]


def test_an_exported_value_wins_over_the_local_default(monkeypatch):
    for k in {**SERVE_FAST_PATH_ENV, **HAPROXY_ENV, **LOCAL_CLUSTER_ENV}:
        monkeypatch.delenv(k, raising=False)  # and restored afterwards: nothing leaks into other tests
    monkeypatch.setenv("RAY_task_events_report_interval_ms", "1000")  # the user wants Ray's task table
    apply_ingress_env("proxy")
    assert os.environ["RAY_task_events_report_interval_ms"] == "1000"
    assert os.environ["LOG_NAME_UPDATE_INTERVAL_S"] == LOCAL_CLUSTER_ENV["LOG_NAME_UPDATE_INTERVAL_S"]
