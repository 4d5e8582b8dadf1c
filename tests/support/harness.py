"""In-process wiring of the core (no Ray, no sockets) for unit tests.

The render port is the real incremental renderer with the tiny model's
tokenizer; the engine port is the ScriptedEngine (a stand-in for a GPU engine)
behind the same chunk stream an EngineReplica produces.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from cluster.config import ModelConfig, ScriptedEngineConfig
from cluster.core.messages import (
    PROMPT_BASE_MISSING,
    EngineFailure,
    EngineRequest,
    RenderJob,
)
from cluster.core.render.renderer import render_job
from cluster.core.render.tokenizer import renderer_for
from cluster.core.safety.classifiers import Classifier
from cluster.core.turn.context import compaction_item
from cluster.core.turn.driver import TurnDriver
from cluster.core.turn.prepare import TurnSettings
from cluster.core.turn.turn import until_stopped
from cluster.engines.output_parser import tool_format, vllm_tool_call_extractor
from cluster.engines.prompts import SessionPrompts
from cluster.engines.scripted.engine import ScriptedEngine
from cluster.engines.stream import OutputFormat, stream_chunks
from cluster.protocol.sealing import Sealer


class InProcessStack:
    def __init__(self, tokenizer, *, verify: bool = True, max_model_len: int = 32768, safety=None,
                 post_work=None, chunk_chars: int = 256, tracer=None, metrics=None, analysis: bool = True,
                 tool_parser: str = "hermes", **scripted: Any) -> None:
        self.renderer = renderer_for(tokenizer, analysis=analysis)
        backend = tokenizer.backend_tokenizer
        self.engine = ScriptedEngine(
            ModelConfig(max_model_len=max_model_len, tool_parser=tool_parser),
            ScriptedEngineConfig(**{"tokens_per_second": 1e6, "prefill_tokens_per_second": 1e9, **scripted}),
            encode=lambda s: backend.encode(s, add_special_tokens=False).ids,
            decode=lambda ids: backend.decode(ids, skip_special_tokens=True),
            decode_raw=lambda ids: backend.decode(ids, skip_special_tokens=False),
        )
        self.decode_raw = lambda ids: backend.decode(list(ids), skip_special_tokens=False)
        self.prompts = SessionPrompts()  # what an EngineReplica keeps: continuations send their tail
        self.extractor = vllm_tool_call_extractor(tool_parser, tokenizer)
        tools = tool_format(tool_parser)  # the family's call markers, as the EngineService reads them
        self.format = OutputFormat(tools.start, tools.end, bare_start=tools.bare_start)
        self.render_jobs: list[RenderJob] = []
        self.engine_requests: list[EngineRequest] = []
        self.mismatches = 0
        self.verify = verify
        self.fail_engine = False
        settings = TurnSettings(model_name="loopserve-tiny", default_max_tokens=64, max_model_len=max_model_len,
                                verify_renders=verify, output_chunk_chars=chunk_chars,
                                max_token_chars=self.renderer.max_token_chars,  # as the connection sets them
                                min_user_message_tokens=self.renderer.min_user_message_tokens)
        self.sealer = Sealer({"test": b"k" * 32}, "test")
        self.driver = TurnDriver(settings, render=self.render, engine=self.engine_port, safety=safety,
                                 post_work=post_work, tracer=tracer, metrics=metrics, sealer=self.sealer)

    async def run(self, body: dict, cache=None) -> dict:
        """One turn through the driver on this stack's session cache: its final Response (a
        request the server refuses raises its ApiError)."""
        from cluster.core.turn.cache import SessionCache
        from cluster.core.turn.turn import TurnRequest, TurnScope
        from cluster.protocol.requests import parse_request

        if cache is None:
            cache = self.cache = getattr(self, "cache", None) or SessionCache()
        events = [ev async for ev in self.driver.run(TurnRequest(parse_request(body), TurnScope(cache, session_key="s")))]
        return events[-1]["response"]

    def compaction(self, summary: str, tenant=None) -> dict:
        """A compaction item sealed by this stack's server, as /responses/compact hands it out."""
        return compaction_item(summary, self.sealer, tenant)

    async def render(self, job):
        self.render_jobs.append(job)
        result, mismatch = render_job(self.renderer, job)
        self.mismatches += mismatch
        return result

    def engine_port(self, req: EngineRequest, stop=None):
        """The engine port: the replica's stream, ending when the turn's stop is set."""
        return until_stopped(self.engine_stream(req), stop)

    async def engine_stream(self, req: EngineRequest):
        """The EngineReplica's path, minus Ray: resolve a tail prompt, run, stream chunks."""
        if self.fail_engine:
            raise RuntimeError("engine replica died")
        self.engine_requests.append(req)
        whole = self.prompts.resolve(req)
        if whole is None:
            yield [EngineFailure(409, "base missing", code=PROMPT_BASE_MISSING)]
            return
        self.prompts.remember(whole)
        async with aclosing(stream_chunks(self.engine, whole, self.extractor, self.format, decode_raw=self.decode_raw)) as chunks:
            async for chunk in chunks:
                yield chunk


class CountingSafety:
    """A safety port over a real classifier that records what it was sent."""

    def __init__(self, classifier: Classifier, delay: float = 0.0) -> None:
        self.classifier = classifier
        self.delay = delay
        self.calls: list[list[str]] = []

    async def __call__(self, texts):
        import asyncio

        self.calls.append(list(texts))
        if self.delay:
            await asyncio.sleep(self.delay)
        return [v.as_dict() for v in self.classifier.classify(texts)]

    @property
    def chars(self) -> int:
        return sum(len(t) for call in self.calls for t in call)
