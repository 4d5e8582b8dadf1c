"""The turn driver: one turn of the Responses API, for HTTP and WebSocket alike.

Resolves the context from `previous_response_id` (connection cache, then a
fallback lookup), validates tool pairing, renders only the new items, streams
the engine's parsed output through the event assembler and leaves the new
`ResponseState` in the cache *before* the terminal event is yielded, so the
next turn never waits. Render and engine are injected ports (Ray handles in
production, fakes in unit tests).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from cluster import telemetry
from cluster.core.events import Event, EventAssembler, build_response
from cluster.core.messages import TurnProgress
from cluster.core.safety.gate import SafetyPort, TurnSafety, turn_input_texts
from cluster.core.turn.cache import ResponseState
from cluster.core.turn.cache_diagnostics import CacheCheck, compare
from cluster.core.turn.compaction import compacted_window, needs_summary, summarise
from cluster.core.turn.context import INCLUDE_REASONING, seal_reasoning
from cluster.core.turn.post_work import PostWorkQueue
from cluster.core.turn.prepare import (
    ItemLookup,
    Prepared,
    RenderPort,
    TurnPreparer,
    TurnSettings,
)
from cluster.core.turn.mcp_steps import McpPort, McpTurn, item_events
from cluster.core.turn.stream import TurnStream
from cluster.core.generation import sampling_of
from cluster.core.turn.controls import generation_of
from cluster.core.turn.turn import (
    EnginePort,
    Rendered,
    Steps,
    Turn,
    TurnRequest,
    TurnScope,
    TurnServices,
    TurnTiming,
)
from cluster.protocol.errors import ApiError, previous_response_not_found, server_error
from cluster.protocol.ids import new_id
from cluster.protocol.requests import PROMPT_CACHE_TTLS, ResponsesRequest, parse_request
from cluster.protocol.sealing import Sealer


CONVERSATION_ENDS = frozenset({"response.completed", "response.incomplete"})


def _is_input_error(exc: BaseException) -> bool:
    """Errors a chat template raises on input it cannot render (client errors, not ours)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers brings jinja2
        TemplateError = ()  # noqa: N806
    return isinstance(exc, (ValueError, TypeError, KeyError, TemplateError))


class TurnDriver:
    def __init__(
        self,
        settings: TurnSettings,
        *,
        render: RenderPort,
        engine: EnginePort,
        safety: Optional[SafetyPort] = None,
        post_work: Optional[PostWorkQueue] = None,
        tracer: Optional[Any] = None,
        metrics: Optional[telemetry.Metrics] = None,
        items: Optional[ItemLookup] = None,
        sealer: Optional[Sealer] = None,
        mcp: Optional[McpPort] = None,
    ) -> None:
        self.settings = settings
        self.model_name = settings.model_name
        self._safety = safety
        # OpenTelemetry: the global (no-op unless `telemetry.setup` ran) unless injected.
        self.tracer = tracer or telemetry.tracer()
        self.metrics = metrics or telemetry.Metrics()
        self.sealer = sealer
        self.preparer = TurnPreparer(settings, render=render, items=items, tracer=self.tracer, sealer=sealer)
        self.services = TurnServices(engine=engine, metrics=self.metrics, tracer=self.tracer, post_work=post_work,
                                     preparer=self.preparer, mcp=mcp)

    async def count_input_tokens(self, req: ResponsesRequest, parent: Optional[ResponseState], owner: str) -> int:
        return await self.preparer.count_input_tokens(req, parent, owner)

    def check_model(self, req: ResponsesRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
                type="invalid_request_error",
            )

    async def _prepare(self, req: ResponsesRequest, parent: Optional[ResponseState], timing: TurnTiming, tctx: Any,
                       owner: Optional[str]) -> tuple[Prepared, Optional[dict[str, Any]]]:
        """The turn's context rendered; with `context_management: [{type: compaction,
        compact_threshold: N}]`, a prompt over N tokens (or over the model's context) is first
        compacted: the model summarises the window (one store:false turn, compaction.py), and the
        turn runs on the user messages plus the compaction item it returns as its first output."""
        threshold = None if req.is_warm_up else req.compact_threshold
        try:
            prep: Optional[Prepared] = await self.preparer.prepare(req, parent, timing, tctx, owner)
        except ApiError as err:
            if threshold is None or err.code != "context_length_exceeded":
                raise
            prep, too_long = None, err
        if threshold is None or (prep is not None and prep.rendered.prompt_len <= threshold):
            return prep, None
        items = prep.context.items if prep is not None else (
            (list(parent.items) if parent is not None else []) + await self.preparer.input_items(req, parent, owner))
        if not needs_summary(items):  # only user messages: nothing a summary could shorten
            if prep is None:
                raise too_long
            return prep, None
        summary, _ = await summarise(self.run, self.settings, items, owner)
        window, item = compacted_window(items, summary, self.sealer, owner)
        self.metrics.compacted()
        return await self.preparer.prepare(req, None, timing, tctx, owner, items=window), item

    async def run(self, t: TurnRequest) -> AsyncIterator[Event]:
        """Yield the events of one response. Errors before `response.created` raise ApiError.

        `received_at`/`parsed_at` (perf_counter) are when the request arrived and
        was parsed, so the turn's server time includes reading, parsing and
        validating it (and queueing). `trace_parent` is the caller's trace
        context (an incoming `traceparent`); the turn is one span tree under it.
        """
        timing = TurnTiming()
        if t.received_at is not None:
            timing.started = t.received_at
        root = self.tracer.start_span("response.create", context=t.scope.trace_parent, kind=telemetry.SpanKind.SERVER,
                                      start_time=telemetry.ns_at(timing.started))
        tctx = telemetry.context_of(root)
        root.set_attribute("loopserve.transport", t.scope.transport)
        root.set_attribute("gen_ai.request.model", self.model_name)
        root.set_attribute("loopserve.session", telemetry.hash_key(t.scope.session_key))
        if t.parsed_at is not None:
            telemetry.span_between(self.tracer, "parse", tctx, telemetry.ns_at(timing.started),
                                   telemetry.ns_at(t.parsed_at))
        progress = TurnProgress()
        rejected = False
        try:
            # `_start` is a coroutine, not a generator: the stream's events come straight
            # through here, one async-generator layer fewer for every event of the turn.
            stream, first_events = await self._start(t, timing, root, tctx)
            streaming = self.tracer.start_span("stream_events", context=tctx)
            try:
                for ev in first_events:
                    progress.observe(ev)
                    yield ev
                # A turn on a conversation appends to it before its terminal event leaves.
                conversation = None if t.request.is_warm_up else t.request.conversation_id
                async for ev in (stream.warm_up() if t.request.is_warm_up else stream.generate()):
                    if conversation and ev["type"] in CONVERSATION_ENDS:
                        ev = await self._append(t, stream, ev)
                    progress.observe(ev)
                    yield ev
            finally:
                stream.safety.cancel()
                if stream.turn.steps.mcp is not None:
                    stream.turn.steps.mcp.cancel()  # calls a turn that ended early no longer waits for
                streaming.end()
                turn = stream.turn
                root.set_attribute("gen_ai.usage.input_tokens", turn.prompt_len)
                root.set_attribute("gen_ai.usage.output_tokens", turn.output_tokens)
                root.set_attribute("loopserve.cached_tokens", turn.cached_tokens)
                # Post-inference work is scheduled even when the client went away
                # mid-turn (tokens were spent); never awaited here.
                stream.schedule_post_work()
        except ApiError as err:
            root.set_attribute("error.type", err.code or str(err.status))
            root.set_status(telemetry.StatusCode.ERROR, err.message[:200])
            rejected = True
            raise
        finally:
            # No terminal event and no rejection: the turn was cancelled (client gone, interrupted).
            status = "rejected" if rejected else progress.status or "cancelled"
            root.set_attribute("loopserve.status", status)
            self.metrics.turn_ended(t.scope.transport, status)
            root.end()

    async def _start(self, t: TurnRequest, timing: TurnTiming, root: Any,
                     tctx: Any) -> tuple[TurnStream, list[Event]]:
        """The turn up to its first events: the context resolved and rendered, the response
        created. Errors before `response.created` raise ApiError."""
        req, scope = t.request, t.scope
        cache, session_key, owner, lookup = scope.cache, scope.session_key, scope.owner, scope.lookup_for(req)
        self.check_model(req)
        parent: Optional[ResponseState] = None
        prev_id = req.previous_response_id
        if prev_id:
            parent = cache.get(prev_id)
            if parent is not None and parent.owner != owner:
                parent = None  # another tenant's response: as if it did not exist
            found = "hit" if parent is not None else "miss"
            if parent is None and lookup is not None:
                parent = await lookup(prev_id)
                found = "store" if parent is not None else "miss"
            root.set_attribute("loopserve.cache", found)
            self.metrics.cache_lookup(found)
            if parent is None:
                raise previous_response_not_found(prev_id)
            if parent.blocked:
                # Not `previous_response_not_found`: clients answer that by replaying
                # the whole input, which would step around the filter. Kept in the
                # cache so every retry gets the same answer.
                reason = ("was stopped by the content filter" if parent.blocked.get("flagged")
                          else f"ended {parent.blocked.get('status', 'without a result')}")
                raise ApiError(400, f"Previous response with id '{prev_id}' {reason} and cannot be continued.",
                               code="previous_response_blocked", param="previous_response_id")
        if req.conversation_id:
            if scope.conversations is None:
                raise ApiError(400, "This server keeps no conversations: it runs without a response store.",
                               param="conversation", code="conversations_unavailable")
            parent = await scope.conversations.parent(req.conversation_id, owner, cache, lookup)
            root.set_attribute("loopserve.cache", "conversation" if parent.rendered is None else "hit")
        if parent is not None and parent.affinity_key:
            # Keep the chain on the engine replica that holds its prefix KV.
            session_key = parent.affinity_key
        mcp = await self._mcp(t, parent, tctx) if any(tool.get("type") == "mcp" for tool in req.tools or []) else None
        if mcp is not None:
            req = mcp.request  # the servers' tools offered as functions; what it output first is input
        compaction: Optional[dict[str, Any]] = None
        try:
            prep, compaction = await self._prepare(req, parent, timing, tctx, owner)
        except ApiError:
            if prev_id and not t.keep_parent:
                cache.evict(prev_id)
            raise
        except Exception as exc:
            if prev_id and not t.keep_parent:
                cache.evict(prev_id)
            cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the render's own error
            if isinstance(cause, ApiError):
                raise cause from None
            if _is_input_error(cause):
                raise ApiError(400, f"The input cannot be rendered with this model's chat template: "
                                    f"{str(cause)[:300]}", param="input", code="invalid_value") from None
            raise server_error(f"Rendering the prompt failed: {type(exc).__name__}") from exc
        ctx, rendered, tools_spec, key = prep.context, prep.rendered, prep.tools, prep.render_key
        if compaction is not None:
            parent = None  # the window stands alone: nothing of the parent's render carries over
        st = self.settings

        # Classify only what no earlier turn classified (new input items); it
        # runs while the engine prefills.
        new_texts = turn_input_texts(ctx.items[ctx.new_start :], req.instructions,
                                     parent.instructions if parent is not None else None,
                                     st.classify_tool_outputs) if self._safety else []
        # Nobody reads a plain or background answer before its end: its tail is classified before it too.
        safety = TurnSafety(self._safety, new_texts, st.output_chunk_chars, tracer=self.tracer, trace_parent=tctx,
                            max_unverified_chars=st.max_unverified_chars,
                            hold_tail=not t.streamed or bool(req.background))
        response_id = t.response_id or new_id("resp")
        timing.response_id = response_id
        root.set_attribute("loopserve.response_id", response_id)
        sampling = sampling_of(req, st.sampling_defaults)  # what the engine runs and the response reports
        response = build_response(response_id=response_id, model=self.model_name, request=t.request,
                                  previous_response_id=prev_id, sampling=sampling)
        seal = None
        if self.sealer is not None and INCLUDE_REASONING in (req.include or []):
            sealer = self.sealer

            def seal(text: str) -> str:
                return seal_reasoning(text, sealer, owner)
        asm = EventAssembler(response, stream_id=t.stream_id, seal_reasoning=seal, first_sequence=int(t.announced))
        room = st.max_model_len - rendered.engine_len
        cache_ttl_s, cache_check = await self._cache_options(t, ctx)
        max_tokens = max(1, min(req.max_output_tokens or st.default_max_tokens, room))
        turn = Turn(origin=t, response_id=response_id, model=self.model_name, session_key=session_key, parent=parent,
                    context=ctx, rendered=rendered, render_key=key, tools=tools_spec, max_tokens=max_tokens,
                    timing=timing, generation=generation_of(req, tools_spec, max_tokens, sampling),
                    trace=tctx, cache_ttl_s=cache_ttl_s, cache_check=cache_check, steps=Steps(inbox=t.agent, mcp=mcp))
        stream = TurnStream(turn, asm, safety, self.services)
        events = asm.start()
        timing.first_event = time.perf_counter() - timing.started
        if compaction is not None:
            events += asm.compaction(compaction)
            turn.steps.output_start = len(asm.response["output"])  # the item is in the context already
        if mcp is not None:
            for item in mcp.before:  # tool lists and approved calls: in the context already (as input)
                events += item_events(asm, item)
            turn.steps.output_start = len(asm.response["output"])
        return stream, events

    async def _mcp(self, t: TurnRequest, parent: Optional[ResponseState], tctx: Any) -> McpTurn:
        """The response's MCP servers: their tools listed (or found in the context), the calls the
        client approved run; the request as the model sees it."""
        req, port = t.request, self.services.mcp
        new_input = req.input_items()
        mcp = await McpTurn.start(port, req.tools or [], parent.items if parent is not None else [], new_input,
                                  t.scope.owner or "", port.max_calls if port is not None else 0, tctx)
        mcp.request = req.model_copy(update={
            "tools": mcp.offered(req.tools or []), "tool_choice": mcp.tool_choice(req.tool_choice),
            "input": parse_request({"input": new_input + mcp.before}).input if mcp.before else req.input})
        return mcp


    async def _append(self, t: TurnRequest, stream: TurnStream, ev: Event) -> Event:
        """The turn's input and output added to its conversation; if that failed, the terminal
        event says so (the response failed: nothing of it is in the conversation)."""
        response = ev["response"]
        if response.get("incomplete_details") and response["incomplete_details"].get("reason") == "content_filter":
            return ev  # a stopped answer is not part of the conversation
        try:
            if stream.turn.state is None:
                raise server_error("The response's state was not kept.")
            await t.scope.conversations.append(t.request.conversation_id, stream.turn.owner, stream.turn.state, response)
            return ev
        except ApiError as err:
            error = {"code": err.code or "server_error", "message": err.message}
            return {**ev, "type": "response.failed", "response": {**response, "status": "failed", "error": error}}

    async def _cache_options(self, t: TurnRequest, ctx: Any) -> tuple[float, Optional[CacheCheck]]:
        """`prompt_cache_options`: the retention the client asks for (seconds), and the comparison
        its `comparison_response_id` asks for (looked up as a parent is: this key's only)."""
        options = t.request.prompt_cache_options
        if options is None:
            return 0.0, None
        ttl_s = PROMPT_CACHE_TTLS[options.ttl]
        cid = options.comparison_response_id
        if not cid:
            return ttl_s, None
        scope = t.scope
        other = scope.cache.get(cid)
        if other is not None and other.owner != scope.owner:
            other = None
        lookup = scope.lookup_for(t.request)
        if other is None and lookup is not None:
            other = await lookup(cid)
        return ttl_s, compare(t.request, self.model_name, ctx.items, other, cid)


__all__ = ["TurnDriver", "TurnSettings", "TurnTiming", "RenderPort", "EnginePort", "Rendered", "Turn", "TurnRequest",
           "TurnScope"]
