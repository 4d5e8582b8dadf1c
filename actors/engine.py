"""EngineReplica: one engine (vLLM or scripted) + the model family's output parser."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import replace
from typing import Any, AsyncIterator, Optional

from ray import serve

from actors.kv_gate import KvGate, pin_key
from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.core.messages import (
    KV_MOVE,
    KV_QUEUE_FULL,
    PROMPT_BASE_MISSING,
    EngineChunk,
    EngineDone,
    EngineFailure,
    EngineQueued,
    EngineRequest,
    ToolCallPiece,
    done_of,
)
from cluster.core.render.tokenizer import load_tokenizer, token_codec
from cluster.engines import Engine, engine_class
from cluster.engines.base import EngineStats
from cluster.engines.channel import ChannelServer, tls_contexts
from cluster.engines.kv_budget import KV_METRICS, BudgetPolicy, QueueFull
from cluster.engines.output_parser import (
    reasoning_tags,
    tool_format,
    vllm_tool_call_extractor,
)
from cluster.engines.prompts import SessionPrompts
from cluster.engines.stream import OutputFormat, coalesce, stream_chunks

log = logging.getLogger("loopserve.engine")


@serve.deployment(name="EngineReplica")
class EngineReplica:
    async def __init__(self, config: LoopserveConfig, engine_cls: Optional[type] = None) -> None:
        self.config = config
        telemetry.setup(config.telemetry, "engine")
        self.tracer = telemetry.tracer()
        self.in_flight = 0
        self.migrations = 0  # sessions this replica sent elsewhere (no room here for too long)
        self._stats_seq = 0
        # sha256 of the last prompts this replica was given, by request (= response) id:
        # lets a test compare what the production render path sent with a full render.
        self.prompt_digests: OrderedDict[str, str] = OrderedDict()
        self.prompt_text_digests: OrderedDict[str, str] = OrderedDict()
        self.prompts = SessionPrompts(config.engine.session_prompts_max_tokens)
        telemetry.Metrics().observe("loopserve.engine.queue_depth", lambda: [(self.in_flight, {})],
                                    "requests in this engine replica (queued or running)")
        self.tokenizer = await asyncio.to_thread(load_tokenizer, config)
        codec = token_codec(self.tokenizer)
        cls = engine_cls or engine_class(config.engine)
        engine_cfg = config.engine.scripted if config.engine.backend == "scripted" else config.engine.vllm
        self.engine: Engine = cls(
            config.model,
            engine_cfg,
            encode=codec.encode,
            decode=codec.decode,
            decode_raw=codec.decode_raw,
        )
        await self.engine.start()
        self.extractor = vllm_tool_call_extractor(config.model.tool_parser, self.tokenizer)
        tools = tool_format(config.model.tool_parser)
        think = reasoning_tags(config.model.reasoning_parser, self.tokenizer)
        self.format = OutputFormat(tools.start, tools.end, think[0], think[1])
        self._decode_raw = codec.decode_raw
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests)
            self.replica_id = "local"
        if config.engine.backend == "vllm":
            await self._warm_up()
        budget = config.engine.kv_budget
        capacity = budget.capacity_tokens or int(getattr(self.engine, "kv_capacity_tokens", 0) or 0)
        # No known capacity (the scripted engine without a modelled cache): nothing to budget.
        block = int(getattr(self.engine, "block_size", 0) or getattr(getattr(self.engine, "kv", None), "block_size", 1))
        policy = BudgetPolicy.of(budget, self._compute_bound(), getattr(self.engine, "lower_tier_tokens_per_s", None))
        self.gate: Optional[KvGate] = KvGate(capacity, policy, block_size=block) if budget.enabled and capacity else None
        metrics = telemetry.Metrics()
        for name, (key, description) in KV_METRICS.items():
            metrics.observe(name, lambda key=key: [(self._exported_kv().get(key, 0), {"replica": self.replica_id})],
                            description)
        self.channel: Optional[ChannelServer] = None
        if config.engine.direct_stream:
            import ray

            self.channel = ChannelServer(self._generate, tls=tls_contexts(config.engine.channel_tls)[0])
            await self.channel.start(config.engine.channel_host or ray.util.get_node_ip_address())

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """The Serve handle's path (a session's first turn, or a fallback): the answer
        names this replica's direct channel for the session's next turns."""
        async with aclosing(self._generate(req, batch=True)) as chunks:
            async for chunk in chunks:
                done = done_of(chunk)
                if self.channel is not None and done is not None:
                    done.channel = self.channel.endpoint
                yield chunk

    async def _generate(self, req: EngineRequest, batch: bool = False) -> AsyncIterator[EngineChunk]:
        """The request's chunks; the direct channel's handler. `batch`: for Serve's handle stream,
        whose every item costs ~1 ms of the replica's CPU, chunks made while the consumer is busy
        leave together (`coalesce`). The channel writes a chunk in microseconds: there the
        chunks go straight out, with no reader task and queue between the engine and the socket
        (if the socket backs up, vLLM's own output collector merges the deltas meanwhile)."""
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
            async with aclosing(self._budgeted(resolved, batch)) as chunks:
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

    async def _budgeted(self, req: EngineRequest, batch: bool) -> AsyncIterator[EngineChunk]:
        """The engine's chunks once the turn's tokens fit the KV budget (`kv_gate.py`): a turn
        that waits says so first (`EngineQueued`); when it ends, its session keeps its prefix
        if it is expected back (its socket is open, or it called tools)."""
        gate = self.gate
        ticket, admitted = None, False
        held, expect_back, produced = req.engine_len, req.expect_back, None
        try:
            if gate is not None:
                key = pin_key(req.cache_salt, req.session_key)
                try:
                    ticket, wait = gate.request(key, req.prompt_token_ids, req.max_tokens, image_tokens=req.image_tokens,
                                                tenant=req.cache_salt or "",
                                                min_ttl_s=req.cache_ttl_s, engine_in_use=self._engine_kv_in_use())
                except QueueFull as full:
                    what = "this key's share of the" if full.tenant_limit else "the"
                    yield [EngineFailure(429, f"The engine's queue is full ({what} turns waiting for KV room). "
                                              f"Try again in {full.retry_after_s:.0f}s.", code=KV_QUEUE_FULL,
                                         retry_after_s=full.retry_after_s)]
                    return
                if wait is not None:
                    yield [EngineQueued(gate.position(ticket), gate.budget.queued_tokens)]
                    if not await self._wait_or_move(wait, key, req):
                        self.migrations += 1
                        yield [EngineFailure(503, "No KV room for this session on its engine replica.",
                                             code=KV_MOVE)]
                        return
                admitted = True
                req = replace(req, kv_pin=key, kv_ttl_s=gate.pin_ttl(key), kv_unpin=gate.take_unpins())
            chunks = stream_chunks(self.engine, req, self.extractor, self.format, replica=self.replica_id,
                                   decode_raw=self._decode_raw)
            if batch:
                chunks = coalesce(chunks, self.config.engine.stream_interval_ms / 1000)
            async with aclosing(chunks):
                async for chunk in chunks:
                    for piece in chunk:
                        if isinstance(piece, ToolCallPiece):
                            expect_back = True
                        elif isinstance(piece, EngineDone):
                            held, produced = piece.prompt_tokens + piece.output_tokens, piece.output_tokens
                            if gate is not None:
                                gate.observe_prefill(piece.prompt_tokens - piece.cached_tokens, piece.first_token_s)
                    yield chunk
        finally:
            if ticket is not None:
                if admitted:
                    gate.finish(ticket, held, expect_back, continuable=req.continuable, output_tokens=produced)
                else:
                    gate.cancel(ticket)

    async def _wait_or_move(self, wait: asyncio.Future, key: str, req: EngineRequest) -> bool:
        """Wait for room; False when the session should move instead: several replicas, it was
        not moved before, it holds nothing here, and it waited `move_after_s`."""
        budget = self.config.engine.kv_budget
        if req.moved or self.config.engine_deployment.max_replicas < 2:
            await wait
            return True
        try:
            await asyncio.wait_for(asyncio.shield(wait), budget.move_after_s)
            return True
        except asyncio.TimeoutError:
            hold = self.gate.budget.sessions.get(key)
            if wait.done() or (hold is not None and (hold.retained or hold.turns)):
                await wait
                return True
            return False

    async def release_session(self, session_key: str, cache_salt: Optional[str] = None) -> None:
        """The session will not be back (its socket closed, nothing stored): its KV goes now."""
        if self.gate is not None:
            self.gate.release(pin_key(cache_salt, session_key))

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
            while len(digests) > 512:
                digests.popitem(last=False)

    def _exported_kv(self) -> dict[str, Any]:
        # Read by the metrics exporter's thread while the replica's loop changes the budget:
        # a read that races a change is skipped (the next export has it).
        try:
            return self.kv_figures()
        except RuntimeError:
            return {}

    def kv_figures(self) -> dict[str, Any]:
        """The KV budget's figures with the engine's own (preemptions, hit ratio, its modelled pool)."""
        kv = self.gate.snapshot() if self.gate is not None else {}
        model = self.engine.kv.stats() if getattr(self.engine, "kv", None) is not None else {}
        s = self.engine.stats
        off = getattr(self.engine, "pins_off_reason", "")
        figures = {**kv, **model, "preemptions": self._preemptions(), "migrations": self.migrations,
                   "hit_ratio": round(s.cached_tokens / s.prompt_tokens, 4) if s.prompt_tokens else 0.0,
                   "pins_enabled": int(not off), "pins_off_reason": off}
        in_use = self._engine_kv_in_use()
        if self.gate is not None and in_use is not None:
            # The budget's count against the engine's own (vLLM's block usage, the modelled pool's):
            # positive when the budget reserves more than the engine holds (output not yet made).
            figures["engine_kv_tokens"] = in_use
            figures["drift_tokens"] = self.gate.budget.used - in_use
        return figures

    def _engine_kv_in_use(self) -> Optional[int]:
        """Tokens of KV the engine itself has in use (blocks referenced), when it says."""
        kv = getattr(self.engine, "kv", None)
        if kv is not None:
            return (kv.num_blocks - len(kv.free)) * kv.block_size
        counter = getattr(self.engine, "preemptions", None)
        capacity = int(getattr(self.engine, "kv_capacity_tokens", 0) or 0)
        if capacity and hasattr(counter, "kv_usage"):
            return int(counter.kv_usage * capacity)
        return None

    async def stats(self) -> dict[str, Any]:
        import ray

        kv = self.kv_figures()
        gate = getattr(self.engine, "grammar_gate", None)
        return {**self.engine.stats.as_dict(), "replica": self.replica_id, "kv": kv,
                "grammar_worker": {"ready": gate.ready, "refused": gate.refused} if gate is not None else None,
                "session_prompts": {"sessions": len(self.prompts), "tokens": self.prompts.tokens, "bytes": self.prompts.nbytes,
                                    "hits": self.prompts.hits, "misses": self.prompts.misses}, "node": ray.get_runtime_context().get_node_id(),
                "in_flight": self.in_flight, "prompt_digests": dict(self.prompt_digests),
                "prompt_text_digests": dict(self.prompt_text_digests)}

    async def _warm_up(self) -> None:
        """One short generation before serving: the first session's first turn would
        otherwise pay for the engine's and the parsers' first-call costs."""
        prompt = array("i", token_codec(self.tokenizer).encode("warm up") or [0])
        req = EngineRequest("loopserve-warmup", "loopserve-warmup", prompt, 2, temperature=0.0,
                            cache_salt="loopserve-warmup")
        try:
            async with aclosing(stream_chunks(self.engine, req, self.extractor, self.format,
                                              decode_raw=self._decode_raw)) as chunks:
                async for _ in chunks:
                    pass
        except Exception as exc:  # noqa: BLE001 - a failed warm-up only costs the first turn time
            log.warning("engine warm-up failed: %s", type(exc).__name__)
        self.engine.stats = EngineStats()  # counters describe served requests only

    def _compute_bound(self) -> bool:
        """Do this engine's prefills share one compute unit (a CPU engine, the scripted engine's
        `serial_prefill`)? The KV budget's wait bound depends on it (engines/kv_budget.py)."""
        if self.config.engine.backend == "scripted":
            return self.config.engine.scripted.serial_prefill
        from cluster.engines.vllm_engine import _on_cpu

        return _on_cpu()

    async def channel_endpoint(self) -> tuple[str, str]:
        """This replica's direct channel ("" when off or draining) and its id: a session placed here
        streams its turns from it (cluster/serving/clients.py)."""
        draining = self.channel is None or self.channel.closing or self.channel.keeps is not None
        return (self.channel.endpoint if not draining else "",
                self.replica_id)

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the KV placement router (cluster/kv_router.py) places new sessions by."""
        if self.gate is None:
            return {}
        self._stats_seq += 1  # routers count their own placements until the next one
        budget = self.gate.budget
        return {"kv_headroom": budget.headroom(), "kv_capacity": budget.capacity,
                "kv_session_tokens": budget.session_tokens(), "kv_stats_seq": self._stats_seq}

    def _preemptions(self) -> int:
        counter = getattr(self.engine, "preemptions", 0)
        return int(getattr(counter, "preemptions", counter) or 0)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What this replica runs, handle and direct-channel requests alike, and its KV demand
        (running + retained + queued tokens over capacity) and queue wait (cluster/autoscaling.py)."""
        stats = {"in_flight": float(self.in_flight)}
        if self.gate is not None:
            snap = self.gate.snapshot()
            stats["kv_demand"] = float(self.gate.budget.demand())
            stats["kv_head_wait_s"] = float(snap["head_wait_s"])
        return stats

    async def check_health(self) -> None:
        llm = getattr(self.engine, "llm", None)
        if llm is not None:
            await llm.check_health()

    async def _drain_retention(self, channel: ChannelServer) -> None:
        """Leaving (scale-down, redeploy): Serve routes no new session here any more, and sessions
        retained here keep their turns on this replica over the direct channel until their retention
        runs out, within half the graceful shutdown window (Serve counts it from the stop: handle
        requests drained first, turns in flight finished after).
        Then the channel closes and they are placed again (counted as moved sessions)."""
        gate = getattr(self, "gate", None)
        if gate is None or not gate.retaining():
            return
        channel.drain(lambda req: gate.holds(pin_key(req.cache_salt, req.session_key)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.5 * self.config.engine_deployment.graceful_shutdown_timeout_s
        while loop.time() < deadline and (gate.retaining() or channel.in_flight):
            await asyncio.sleep(0.2)

    async def __del__(self) -> None:
        # Serve runs this after a constructor that failed part-way too: what was not made is
        # skipped, and an engine that started is still shut down (its processes would outlive us).
        channel, engine = getattr(self, "channel", None), getattr(self, "engine", None)
        if channel is not None:
            await self._drain_retention(channel)
            # Draining: new turns go back through the handle (to live replicas); the
            # ones streaming here finish first.
            await channel.close()
            for _ in range(600):
                if not channel.in_flight:
                    break
                await asyncio.sleep(0.1)
        if engine is not None:
            try:
                await engine.shutdown()
            except Exception:
                pass
