"""`loopserve-tiny-qwen3`: a tiny Qwen3 made here, nothing downloaded.

The tokenizer is Qwen3's real one (its vocabulary from the `quicktok-v1` package,
`cluster/models/quicktok_vocab.py`) with Qwen3's published chat template (`templates/qwen3.jinja`:
reasoning kept only after the last user query, tool outputs as `<tool_response>` user turns).
The model is a 2-layer `Qwen3ForCausalLM` with random weights (hidden 128, head_dim 64), in
bfloat16, so vLLM's CPU engine runs the architecture end to end; its answers are noise.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.models.folders import ensure_folder, save_random_model
from cluster.models.quicktok_vocab import QWEN3, fast_tokenizer

FORMAT_VERSION = "1"
TEMPLATE = Path(__file__).parent / "templates" / "qwen3.jinja"


def build(path: Path, weights: bool = True) -> None:
    from transformers import GenerationConfig, Qwen3Config

    tokenizer = fast_tokenizer(QWEN3, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=40960,
        eos_token_id=stops[0], pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], dtype="bfloat16")
    generation = GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    save_random_model(path, config, generation, weights)
    (path / "loopserve_model.json").write_text(json.dumps({"format": FORMAT_VERSION, "weights": weights}))


def ensure_tiny_qwen3_model(path: Path, weights: bool) -> Path:
    return ensure_folder(path, FORMAT_VERSION, weights, build)
