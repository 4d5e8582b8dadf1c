"""RenderActor: the model's HF tokenizer + chat template, rendering only new items."""

from __future__ import annotations

import logging
from typing import Any, Optional

from ray import serve

from cluster.config import LoopserveConfig
from cluster.core.render import RenderResult, render_job
from cluster.tokenizer import load_tokenizer, renderer_for

log = logging.getLogger("loopserve.render")


@serve.deployment(name="RenderActor")
class RenderActor:
    def __init__(self, config: LoopserveConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.renderer = renderer_for(self.tokenizer)
        self.mismatches = 0

    async def render(self, job: dict[str, Any]) -> Optional[RenderResult]:
        result, mismatch = render_job(self.renderer, job)
        if mismatch:
            self.mismatches += 1
            log.error("incremental render differs from the full render; used the full one")
        return result

    async def stats(self) -> dict[str, int]:
        return {
            "full_renders": self.renderer.full_renders,
            "delta_renders": self.renderer.delta_renders,
            "mismatches": self.mismatches,
        }
