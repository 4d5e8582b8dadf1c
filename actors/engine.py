"""EngineReplica: one engine (vLLM or scripted) + the model family's output parser."""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections import OrderedDict
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from ray import serve

from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.engines import Engine, engine_class
from cluster.engines.parsers import reasoning_tags, tool_format, vllm_tool_call_extractor
from cluster.engines.stream import OutputFormat, coalesce, stream_chunks

from cluster.tokenizer import load_tokenizer

log = logging.getLogger("loopserve.engine")


@serve.deployment(name="EngineReplica")
class EngineReplica:
    async def __init__(self, config: LoopserveConfig, engine_cls: Optional[type] = None) -> None:
        self.config = config
        telemetry.setup(config.telemetry, "engine")
        self.tracer = telemetry.tracer()
        self.in_flight = 0
        # sha256 of the last prompts this replica was given, by request (= response) id:
        # lets a test compare what the production render path sent with a full render.
        self.prompt_digests: OrderedDict[str, str] = OrderedDict()
        telemetry.Metrics().observe("loopserve.engine.queue_depth", lambda: [(self.in_flight, {})],
                                    "requests in this engine replica (queued or running)")
        self.tokenizer = await asyncio.to_thread(load_tokenizer, config)
        backend = self.tokenizer.backend_tokenizer
        cls = engine_cls or engine_class(config.engine)
        engine_cfg = config.engine.scripted if config.engine.backend == "scripted" else config.engine.vllm
        self.engine: Engine = cls(
            config.model,
            engine_cfg,
            encode=lambda s: backend.encode(s, add_special_tokens=False).ids,
            decode=lambda ids: backend.decode(ids, skip_special_tokens=True),
        )
        await self.engine.start()
        self.extractor = vllm_tool_call_extractor(config.model.tool_parser, self.tokenizer)
        tools = tool_format(config.model.tool_parser)
        think = reasoning_tags(config.model.reasoning_parser, self.tokenizer)
        self.format = OutputFormat(tools.start, tools.end, think[0], think[1])
        self._decode_tail = lambda ids: backend.decode(list(ids), skip_special_tokens=False)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests)
            self.replica_id = "local"

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        start_ns = time.time_ns()
        span = self.tracer.start_span("engine.generate", context=telemetry.extract(req.get("trace")),
                                      kind=telemetry.SpanKind.SERVER, start_time=start_ns)
        self.in_flight += 1
        chunks = coalesce(stream_chunks(
            self.engine, req, self.extractor, self.format, replica=self.replica_id, decode_tail=self._decode_tail
        ), self.config.engine.stream_interval_ms / 1000)
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk and chunk[-1].get("t") == "done":
                        sent = int(req.get("sent_at_ns") or start_ns)
                        chunk[-1]["dispatch_s"] = max(0, start_ns - sent) / 1e9  # same host clock or NTP
                        if span.is_recording():
                            self._engine_spans(span, req, start_ns, chunk[-1])
                    yield chunk
        finally:
            self.in_flight -= 1
            span.end()
            self._digest(req)  # O(prompt): after the stream, never before the first token

    def _engine_spans(self, span, req: dict[str, Any], start_ns: int, done: dict[str, Any]) -> None:
        """Queue wait, prefill and decode as child spans, from the engine's own clock."""
        ctx = telemetry.context_of(span)
        sent = int(req.get("sent_at_ns") or start_ns)
        first = start_ns + int(float(done.get("first_token_s") or 0.0) * 1e9)
        end = start_ns + int(float(done.get("engine_s") or 0.0) * 1e9)
        telemetry.span_between(self.tracer, "engine.queue_wait", ctx, min(sent, start_ns), start_ns)
        telemetry.span_between(self.tracer, "engine.prefill", ctx, start_ns, first,
                               {"gen_ai.usage.input_tokens": done.get("prompt_tokens", 0),
                                "loopserve.cached_tokens": done.get("cached_tokens", 0)})
        telemetry.span_between(self.tracer, "engine.decode", ctx, first, end,
                               {"gen_ai.usage.output_tokens": done.get("output_tokens", 0)})
        span.set_attribute("gen_ai.response.time_to_first_token_ms", (first - start_ns) / 1e6)
        span.set_attribute("loopserve.engine.replica", self.replica_id)

    def _digest(self, req: dict[str, Any]) -> None:
        ids = req["prompt_token_ids"]
        data = ids.tobytes() if isinstance(ids, array) else array("i", ids).tobytes()
        self.prompt_digests[req["request_id"]] = hashlib.sha256(data).hexdigest()
        while len(self.prompt_digests) > 512:
            self.prompt_digests.popitem(last=False)

    async def stats(self) -> dict[str, Any]:
        import ray

        return {**self.engine.stats.as_dict(), "replica": self.replica_id, "node": ray.get_runtime_context().get_node_id(),
                "in_flight": self.in_flight, "prompt_digests": dict(self.prompt_digests)}

    async def check_health(self) -> None:
        llm = getattr(self.engine, "llm", None)
        if llm is not None:
            await llm.check_health()

    async def __del__(self) -> None:
        try:
            await self.engine.shutdown()
        except Exception:
            pass
