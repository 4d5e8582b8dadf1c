"""An engine replica's serving logic without Ray: its engine and the model family's output parser,
the sessions' last prompts (a continuation sends only its tail), the KV admission, spans, and the
figures the replica reports. `actors/engine.py` is Serve's thin shim around it (and the channel)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from collections import OrderedDict
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.core.messages import PROMPT_BASE_MISSING, EngineChunk, EngineDone, EngineFailure, EngineRequest, done_of
from cluster.core.render.tokenizer import load_tokenizer, token_codec
from cluster.config.backends import backend_of
from cluster.config.renderers import renderer_of
from cluster.models.o200k import harmony_encoding
from cluster.core.messages import Generation
from cluster.engines import Engine, engine_class
from cluster.engines.base import EngineStats
from cluster.engines.kv.admission import KvAdmission
from cluster.engines.harmony_output import HarmonyOutputParser
from cluster.engines.output_parser import reasoning_tags, tool_format, vllm_tool_call_extractor
from cluster.engines.prompts import SessionPrompts
from cluster.engines.stream import OutputFormat, coalesce, stream_chunks

log = logging.getLogger("loopserve.engine")
DIGESTS_KEPT = 512


class EngineService:
    def __init__(self, config: LoopserveConfig, engine: Engine, tokenizer: Any, replica_id: str) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.replica_id = replica_id
        self.tracer = telemetry.tracer()
        self.in_flight = 0
        self.prompts = SessionPrompts(config.engine.session_prompts_max_tokens)
        # sha256 of the last prompts this replica was given, by request (= response) id:
        # lets a test compare what the production render path sent with a full render.
        self.prompt_digests: OrderedDict[str, str] = OrderedDict()
        self.prompt_text_digests: OrderedDict[str, str] = OrderedDict()
        self._decode_raw = token_codec(tokenizer).decode_raw
        self.extractor = vllm_tool_call_extractor(config.model.tool_parser, tokenizer)
        tools = tool_format(config.model.tool_parser)
        think = reasoning_tags(config.model.reasoning_parser, tokenizer)
        self.format = OutputFormat(tools.start, tools.end, think[0], think[1], tools.bare_start)
        # A family whose output is read from its tokens (harmony): its encoding, for a parser per request.
        self._harmony = (harmony_encoding(config.model.resolved_path())
                         if renderer_of(config.model).output == "harmony" else None)
        self.admission: Optional[KvAdmission] = None

    @classmethod
    async def build(cls, config: LoopserveConfig, engine_cls: Optional[type] = None,
                    replica_id: str = "local") -> EngineService:
        """Load the tokenizer, start the engine (the class injected, or the configured backend's),
        warm it up and size the KV budget from it. An engine that started is shut down again if a
        later step fails (its processes would outlive the replica)."""
        tokenizer = await asyncio.to_thread(load_tokenizer, config)
        codec = token_codec(tokenizer)
        backend = backend_of(config.engine)
        engine_cfg = backend.settings(config.engine)
        engine: Engine = (engine_cls or engine_class(config.engine))(
            config.model, engine_cfg, encode=codec.encode, decode=codec.decode, decode_raw=codec.decode_raw)
        await engine.start()
        try:
            service = cls(config, engine, tokenizer, replica_id)
            if backend.warms_up:
                await service.warm_up()
            service.admission = KvAdmission.of(engine, config.engine.kv_budget,
                                               config.engine_deployment.max_replicas)
        except BaseException:
            await engine.shutdown()
            raise
        return service

    async def generate(self, req: EngineRequest, batch: bool = False) -> AsyncIterator[EngineChunk]:
        """The request's chunks. `batch`: for Serve's handle stream, whose every item costs ~1 ms of
        the replica's CPU, chunks made while the consumer is busy leave together (`coalesce`). The
        direct channel writes a chunk in microseconds: there the chunks go straight out, with no
        reader task and queue between the engine and the socket (if the socket backs up, vLLM's own
        output collector merges the deltas meanwhile)."""
        start_ns = time.time_ns()
        span = self.tracer.start_span("engine.generate", context=telemetry.extract(req.trace),
                                      kind=telemetry.SpanKind.SERVER, start_time=start_ns)
        self.in_flight += 1
        try:
            resolved = self.prompts.resolve(req)
            if resolved is None:  # the caller resends the whole prompt
                yield [EngineFailure(409, "The prompt's base is not on this engine replica.", code=PROMPT_BASE_MISSING)]
                return
            self.prompts.remember(resolved)
            admission = self.admission
            budgeted = (admission.run(resolved, lambda r: self._stream(r, batch)) if admission is not None
                        else self._stream(resolved, batch))
            async with aclosing(budgeted) as chunks:
                async for chunk in chunks:
                    done = done_of(chunk)
                    if done is not None:
                        done.dispatch_s = max(0, start_ns - (req.sent_at_ns or start_ns)) / 1e9  # same host or NTP
                        if span.is_recording():
                            self._engine_spans(span, req, start_ns, done)
                    yield chunk
            self._digest(resolved)  # O(prompt): after the stream, never before the first token
        finally:
            self.in_flight -= 1
            span.end()

    def _stream(self, req: EngineRequest, batch: bool) -> AsyncIterator[EngineChunk]:
        chunks = stream_chunks(self.engine, req, self.extractor, self.format, replica=self.replica_id,
                               decode_raw=self._decode_raw, parser=self._output_parser(req))
        return coalesce(chunks, self.config.engine.stream_interval_ms / 1000) if batch else chunks

    def _output_parser(self, req: EngineRequest) -> Optional[HarmonyOutputParser]:
        """The family's own output parser (None: the text splitter, `self.format`)."""
        if self._harmony is None:
            return None
        gen = req.generation
        return HarmonyOutputParser(self._harmony, tools_enabled=bool(gen.tools) and gen.tool_choice != "none")

    def release(self, session_key: str, cache_salt: Optional[str]) -> None:
        """The session will not be back (its socket closed, nothing stored): its KV goes now."""
        if self.admission is not None:
            self.admission.release(session_key, cache_salt)

    def _engine_spans(self, span, req: EngineRequest, start_ns: int, done: EngineDone) -> None:
        """Queue wait, prefill and decode as child spans, from the engine's own clock."""
        ctx = telemetry.context_of(span)
        sent = req.sent_at_ns or start_ns
        first = start_ns + int(done.first_token_s * 1e9)
        end = start_ns + int(done.engine_s * 1e9)
        telemetry.span_between(self.tracer, "engine.queue_wait", ctx, min(sent, start_ns), start_ns)
        telemetry.span_between(self.tracer, "engine.prefill", ctx, start_ns, first,
                               {"gen_ai.usage.input_tokens": done.prompt_tokens,
                                "loopserve.cached_tokens": done.cached_tokens})
        telemetry.span_between(self.tracer, "engine.decode", ctx, first, end,
                               {"gen_ai.usage.output_tokens": done.output_tokens})
        span.set_attribute("gen_ai.response.time_to_first_token_ms", (first - start_ns) / 1e6)
        span.set_attribute("loopserve.engine.replica", self.replica_id)

    def _digest(self, req: EngineRequest) -> None:
        self.prompt_digests[req.request_id] = hashlib.sha256(req.prompt_token_ids).hexdigest()  # its bytes, uncopied
        if self.config.ops.prompt_text_digests:
            text = self._decode_raw(req.prompt_token_ids)
            self.prompt_text_digests[req.request_id] = hashlib.sha256(text.encode()).hexdigest()
        for digests in (self.prompt_digests, self.prompt_text_digests):
            while len(digests) > DIGESTS_KEPT:
                digests.popitem(last=False)

    def kv_figures(self) -> dict[str, Any]:
        """The KV budget's figures with the engine's own (preemptions, hit ratio, its modelled pool)."""
        s, off = self.engine.stats, self.engine.pins_off_reason
        admission = self.admission
        return {**(admission.figures() if admission is not None else {}), **self.engine.kv_stats(),
                "migrations": admission.migrations if admission is not None else 0,
                "hit_ratio": round(s.cached_tokens / s.prompt_tokens, 4) if s.prompt_tokens else 0.0,
                "pins_enabled": int(not off), "pins_off_reason": off}

    def exported_kv(self) -> dict[str, Any]:
        # Read by the metrics exporter's thread while the replica's loop changes the budget:
        # a read that races a change is skipped (the next export has it).
        try:
            return self.kv_figures()
        except RuntimeError:
            return {}

    def stats(self) -> dict[str, Any]:
        p = self.prompts
        return {**self.engine.stats.as_dict(), "replica": self.replica_id, "kv": self.kv_figures(),
                "grammar_worker": self.engine.grammar_worker(),
                "session_prompts": {"sessions": len(p), "tokens": p.tokens, "bytes": p.nbytes, "hits": p.hits,
                                    "misses": p.misses},
                "in_flight": self.in_flight, "prompt_digests": dict(self.prompt_digests),
                "prompt_text_digests": dict(self.prompt_text_digests)}

    async def warm_up(self) -> None:
        """One short generation before serving: the first session's first turn would
        otherwise pay for the engine's and the parsers' first-call costs."""
        prompt = array("i", token_codec(self.tokenizer).encode("warm up") or [0])
        req = EngineRequest("loopserve-warmup", "loopserve-warmup", prompt, Generation(2, sampling={"temperature": 0.0}),
                            cache_salt="loopserve-warmup")
        try:
            async with aclosing(stream_chunks(self.engine, req, self.extractor, self.format,
                                              decode_raw=self._decode_raw, parser=self._output_parser(req))) as chunks:
                async for _ in chunks:
                    pass
        except Exception as exc:  # noqa: BLE001 - a failed warm-up only costs the first turn time
            log.warning("engine warm-up failed: %s", type(exc).__name__)
        self.engine.stats = EngineStats()  # counters describe served requests only
