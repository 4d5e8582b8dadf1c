"""SafetyActor: classifies only what it is sent (new input, output chunks)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Optional

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.core.safety import (
    Classifier,
    CombinedClassifier,
    PolicyClassifier,
    ProfanityClassifier,
    Verdict,
    guard_prompt,
    guard_verdict,
)

log = logging.getLogger("loopserve.safety")


@serve.deployment(name="SafetyActor")
class SafetyActor:
    async def __init__(self, config: LoopserveConfig, guard: Optional[DeploymentHandle] = None) -> None:
        cfg = config.safety
        self.config = config
        telemetry.setup(config.telemetry, "safety")
        self.tracer = telemetry.tracer()
        members: list[Classifier] = []
        if cfg.policy:
            members.append(PolicyClassifier(cfg.policy))
        if cfg.classifier == "default":
            members.append(await asyncio.to_thread(ProfanityClassifier, cfg.profanity_threshold))
        self.local = CombinedClassifier(members)
        self.guard = guard.options(stream=True) if (cfg.classifier == "guard" and guard is not None) else None
        self.guard_tokenizer = None
        if self.guard is not None:
            from cluster.tokenizer import load_tokenizer

            guard_cfg = LoopserveConfig(model=cfg.guard.model, engine=cfg.guard.engine, safety={"enabled": False})
            self.guard_tokenizer = await asyncio.to_thread(load_tokenizer, guard_cfg)
        self.texts = 0
        self.chars = 0
        self.flagged = 0
        self.guard_unparseable = 0

    async def classify(self, texts: list[str], trace: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
        """Verdicts for `texts`; `trace` is the caller's W3C context (one span tree per turn)."""
        with self.tracer.start_as_current_span("safety.classify", context=telemetry.extract(trace),
                                               kind=telemetry.SpanKind.SERVER) as span:
            self.texts += len(texts)
            self.chars += sum(len(t) for t in texts)
            verdicts = self.local.classify(texts)
            if self.guard is not None:
                guard = await asyncio.gather(*[self._guard_one(t) for t in texts])
                verdicts = [v if v.flagged else g for v, g in zip(verdicts, guard)]
            flagged = sum(v.flagged for v in verdicts)
            self.flagged += flagged
            span.set_attribute("loopserve.safety.texts", len(texts))
            span.set_attribute("loopserve.safety.flagged", flagged)
            return [v.as_dict() for v in verdicts]

    async def _guard_one(self, text: str) -> Verdict:
        tok = self.guard_tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": guard_prompt(text)}], tokenize=False,
                                         add_generation_prompt=True)
        ids = tok.backend_tokenizer.encode(prompt, add_special_tokens=False).ids
        req = {
            "request_id": f"guard-{uuid.uuid4().hex}",
            "session_key": "guard",
            "prompt_token_ids": ids,
            "max_tokens": self.config.safety.guard.max_tokens,
            "temperature": 0.0,
            "tools": [],
            "tool_choice": "none",
            "last_item": "user",
        }
        out = []
        async for chunk in self.guard.generate.remote(req):
            out.extend(p["v"] for p in chunk if p["t"] == "text")
        answer = "".join(out)
        verdict, unparseable = guard_verdict(answer, self.config.safety.guard.on_unparseable)
        if unparseable:
            self.guard_unparseable += 1
            log.warning("guard answer is neither 'safe' nor 'unsafe' (%d chars); policy %r -> %s", len(answer),
                        self.config.safety.guard.on_unparseable, "flagged" if verdict.flagged else "allowed")
        return verdict

    async def stats(self) -> dict[str, int]:
        return {"texts": self.texts, "chars": self.chars, "flagged": self.flagged,
                "guard_unparseable": self.guard_unparseable}
