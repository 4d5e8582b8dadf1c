"""SafetyActor: a guard model's classifications (plus the local classifiers), off the
connection replica. The local classifiers alone run inline in the connection replica
(`safety.placement: inline`); this deployment exists for `placement: actor` and guards."""

from __future__ import annotations

import asyncio
import logging
import uuid
from array import array
from typing import Any, Optional

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.core.messages import Generation
from cluster.core.messages import EngineRequest, TextPiece
from cluster.core.render.chat_messages import ContentGuard
from cluster.core.safety.classifiers import (SafetyService, Verdict, guard_prompt_ids, guard_verdict,
                                             local_classifier)

log = logging.getLogger("loopserve.safety")


@serve.deployment(name="SafetyActor")
class SafetyActor:
    async def __init__(self, config: LoopserveConfig, guard: Optional[DeploymentHandle] = None) -> None:
        cfg = config.safety
        self.config = config
        telemetry.setup(config.telemetry, "safety")
        local = await asyncio.to_thread(local_classifier, cfg.policy, cfg.classifier, cfg.profanity_threshold)
        self.guard = guard.options(stream=True) if (cfg.classifier == "guard" and guard is not None) else None
        self.guard_tokenizer = None
        if self.guard is not None:
            from cluster.core.render.tokenizer import load_tokenizer, token_codec

            guard_cfg = LoopserveConfig(model=cfg.guard.model, engine=cfg.guard.engine, safety={"enabled": False})
            self.guard_tokenizer = await asyncio.to_thread(load_tokenizer, guard_cfg)
            self._content = ContentGuard(list(self.guard_tokenizer.get_added_vocab()),
                                         token_codec(self.guard_tokenizer).encode)
        self.service = SafetyService(local, guard=self._guard_all if self.guard is not None else None,
                                     tracer=telemetry.tracer())

    async def classify(self, texts: list[str], trace: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
        """Verdicts for `texts`; `trace` is the caller's W3C context (one span tree per turn)."""
        return await self.service.classify(texts, telemetry.extract(trace))

    async def _guard_all(self, texts: list[str]) -> list[Verdict]:
        return list(await asyncio.gather(*[self._guard_one(t) for t in texts]))

    async def _guard_one(self, text: str) -> Verdict:
        ids = guard_prompt_ids(self.guard_tokenizer, self._content, text)
        req = EngineRequest(f"guard-{uuid.uuid4().hex}", "guard", array("i", ids),
                            Generation(self.config.safety.guard.max_tokens, sampling={"temperature": 0.0}, tool_choice="none"))
        out = []
        async for chunk in self.guard.generate.remote(req):
            out.extend(p.text for p in chunk if isinstance(p, TextPiece))
        answer = "".join(out)
        policy = self.config.safety.guard.on_unparseable
        verdict, unparseable = guard_verdict(answer, policy)
        if unparseable:
            self.service.guard_unparseable += 1
            log.warning("guard answer is neither 'safe' nor 'unsafe' (%d chars); policy %r -> %s", len(answer),
                        policy, "flagged" if verdict.flagged else "allowed")
        return verdict

    async def stats(self) -> dict[str, int]:
        return self.service.stats()
