"""The loopserve systems of the sessions bench (cluster/bench/session_systems.py): the app args
an engine model's run deploys."""

import pytest

from cluster.bench.session_systems import loopserve_args
from cluster.engines.scripted.cost_model import PRESETS


@pytest.mark.parametrize("model, context", [("h100-8b-long", 131_072), ("cpu", 8192)])
def test_an_engine_models_run_serves_its_named_models_context_and_kv_pool(model, context):
    # h100-8b-long's sessions (30-120k tokens) outgrow the config's SmolLM2 context (8k): each of
    # their turns past it was refused with context_length_exceeded.
    args = loopserve_args("serve_configs/local.yaml", "scripted", 4, None, True, (1500.0, 60.0),
                          sessions=32, engine_model=model)
    assert args["model"]["max_model_len"] == context == PRESETS[model].max_model_len
    assert args["engine"]["scripted"]["kv_capacity_tokens"] == PRESETS[model].kv_capacity_tokens
    assert args["engine"]["scripted"]["preset"] == model
