"""The served model's HF tokenizer and chat template, wired into the core renderer."""

from __future__ import annotations

from .config import LoopserveConfig
from .core.render import IncrementalRenderer


def load_tokenizer(config: LoopserveConfig):
    from transformers import AutoTokenizer

    if config.model.is_generated:
        from .builtin_models import ensure_builtin

        # Weights only where an engine loads them (or torch is there anyway).
        ensure_builtin(config.model.builtin, weights=True if config.engine.backend == "vllm" else None)
    return AutoTokenizer.from_pretrained(config.model.resolved_path())


def renderer_for(tokenizer) -> IncrementalRenderer:
    backend = tokenizer.backend_tokenizer  # the Rust tokenizer: no Python-side overhead

    def apply(messages, tools, add_generation_prompt):
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    renderer = IncrementalRenderer(apply, encode, list(tokenizer.get_added_vocab().keys()))
    renderer.warm_up()
    return renderer
