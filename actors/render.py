"""RenderActor: the model's HF tokenizer + chat template, rendering only new items."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from ray import serve

from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.core.messages import RenderJob
from cluster.core.render.renderer import RenderResult, render_job
from cluster.core.render.tokenizer import attach_images, load_tokenizer, renderer_for, watch_fallbacks

log = logging.getLogger("loopserve.render")


@serve.deployment(name="RenderActor")
class RenderActor:
    def __init__(self, config: LoopserveConfig) -> None:
        self.config = config
        telemetry.setup(config.telemetry, "render")
        self.tracer = telemetry.tracer()
        self.tokenizer = load_tokenizer(config)
        self.renderer = renderer_for(self.tokenizer, analysis=config.template_analysis, model=config.model)
        attach_images(self.renderer, config)
        watch_fallbacks(self.renderer, telemetry.Metrics())
        self.mismatches = 0

    async def render(self, job: RenderJob) -> Optional[RenderResult]:
        with self.tracer.start_as_current_span("render.execute", context=telemetry.extract(job.trace),
                                               kind=telemetry.SpanKind.SERVER) as span:
            span.set_attribute("loopserve.render.mode", job.mode)
            if job.inline_ok:
                result, mismatch = render_job(self.renderer, job)  # O(new items): inline
            else:
                # O(history): off the replica's event loop (it also serves health checks).
                result, mismatch = await asyncio.to_thread(render_job, self.renderer, job)
        if mismatch:
            self.mismatches += 1
            log.error("incremental render differs from the full render; used the full one")
        return result

    async def stats(self) -> dict[str, object]:
        return {**self.renderer.stats(), "mismatches": self.mismatches}
