import pytest

from cluster.models.folders import DEFAULT_MODEL_DIR


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The locally generated tiny model (tokenizer + chat template + random weights)."""
    from cluster.models.tiny import ensure_tiny_model

    return ensure_tiny_model(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
