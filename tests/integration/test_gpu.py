"""GPU-only paths: vLLM (CUDA) with tensor parallelism in a placement group."""

import pytest

pytestmark = pytest.mark.integration


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


@pytest.mark.skipif(_gpus() == 0, reason="no GPU on this machine: the CUDA vLLM / tensor-parallel path is not run")
def test_tensor_parallel_engine_serves_a_turn(serve_instance, client_for):
    from tests.support.apps import deploy_app

    tp = 2 if _gpus() >= 2 else 1
    args = {
        "model": {"max_model_len": 4096},
        "engine": {"backend": "vllm", "vllm": {"tensor_parallel_size": tp, "default_max_tokens": 8}},
        "engine_deployment": {"ray_actor_options": {"num_gpus": 1, "num_cpus": 1}},
    }
    url = deploy_app("gpu", "/gpu", args, serve_instance, 600)
    resp = client_for(url).responses.create(model="loopserve-tiny", input="hi")
    assert resp.status in ("completed", "incomplete")
