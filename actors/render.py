"""RenderActor: the model's HF tokenizer + chat template, rendering only new items."""

from __future__ import annotations

import logging
from typing import Any, Optional

from ray import serve

from cluster.config import LoopserveConfig
from cluster.core.render import IncrementalRenderer, RenderResult

log = logging.getLogger("loopserve.render")


def load_tokenizer(config: LoopserveConfig):
    from transformers import AutoTokenizer

    if config.model.is_generated:
        from cluster.tiny_model import ensure_tiny_model

        ensure_tiny_model(config.model.resolved_path())
    return AutoTokenizer.from_pretrained(config.model.resolved_path())


def renderer_for(tokenizer) -> IncrementalRenderer:
    backend = tokenizer.backend_tokenizer  # the Rust tokenizer: no Python-side overhead

    def apply(messages, tools, add_generation_prompt):
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    return IncrementalRenderer(apply, encode, list(tokenizer.get_added_vocab().keys()))


@serve.deployment(name="RenderActor")
class RenderActor:
    def __init__(self, config: LoopserveConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.renderer = renderer_for(self.tokenizer)
        self.mismatches = 0

    async def render(self, job: dict[str, Any]) -> Optional[RenderResult]:
        r = self.renderer
        if job["mode"] == "full":
            return r.full(job["items"], job["instructions"], job["tools"])
        res = r.delta(
            job["prefix_token_ids"],
            job["anchor_items"],
            job["new_items"],
            job["anchor_start"],
            job["instructions"],
            job["tools"],
        )
        if res is not None and job.get("verify_items") is not None:
            full = r.full(job["verify_items"], job["instructions"], job["tools"])
            if full.prompt_token_ids != res.prompt_token_ids:
                self.mismatches += 1
                log.error("incremental render differs from the full render; using the full one")
                return full
        return res

    async def stats(self) -> dict[str, int]:
        return {
            "full_renders": self.renderer.full_renders,
            "delta_renders": self.renderer.delta_renders,
            "mismatches": self.mismatches,
        }
