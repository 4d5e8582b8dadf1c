from typing import get_args

from cluster.config import ModelConfig
from cluster.models.names import (BUILTIN_NAMES, SMOLLM2, TINY, TINY_DEEPSEEK_R1, TINY_GPTOSS, TINY_LLAMA3, TINY_QWEN3,
                                  TINY_QWEN3_CODER, TINY_VISION)


def test_the_config_and_the_cli_offer_exactly_the_models_the_builders_make(monkeypatch, tmp_path):
    """A built-in model added in one place is offered everywhere (config, `loopserve make-model`)."""
    import cluster.cli as cli
    from cluster.models import builtin

    assert get_args(ModelConfig.model_fields["builtin"].annotation) == BUILTIN_NAMES == cli.BUILTIN_NAMES
    assert set(BUILTIN_NAMES) == {SMOLLM2, TINY, TINY_VISION, TINY_GPTOSS, TINY_QWEN3, TINY_LLAMA3,
                                 TINY_QWEN3_CODER, TINY_DEEPSEEK_R1} and ModelConfig().builtin == TINY
    made = []
    monkeypatch.setattr(builtin, "ensure_folder", lambda path, *a: made.append(("smollm2", path)) or path)
    monkeypatch.setattr(builtin, "ensure_tiny_vision_model", lambda path, w: made.append(("vision", path)) or path)
    monkeypatch.setattr(builtin, "ensure_tiny_model", lambda path, w: made.append(("tiny", path)) or path)
    monkeypatch.setattr(builtin, "ensure_tiny_gptoss_model", lambda path, w: made.append(("gptoss", path)) or path)
    for name in BUILTIN_NAMES:
        builtin.ensure_builtin(name, weights=False)
    assert [kind for kind, _ in made] == ["smollm2", "tiny", "vision", "gptoss"]
