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
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Protocol

from cluster import telemetry
from cluster.core.events import TERMINAL_EVENTS, Event, EventAssembler, build_response
from cluster.core.messages import RenderJob
from cluster.core.render.renderer import RenderResult
from cluster.core.safety.gate import SafetyPort, TurnSafety, turn_input_texts
from cluster.core.turn.context import ResolvedContext, normalize_tools, reject_non_text, resolve_context
from cluster.core.turn.controls import check_output_controls
from cluster.core.turn.post_work import PostWorkQueue
from cluster.core.turn.state import RenderKey, ResponseState, items_nbytes
from cluster.core.turn.stream import TurnStream
from cluster.core.turn.turn import EnginePort, Rendered, Turn, TurnRequest, TurnServices, TurnTiming
from cluster.protocol.errors import ApiError, previous_response_not_found, server_error
from cluster.protocol.ids import new_id
from cluster.protocol.requests import ResponsesRequest, parse_request


def _is_input_error(exc: BaseException) -> bool:
    """Errors a chat template raises on input it cannot render (client errors, not ours)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers brings jinja2
        TemplateError = ()  # noqa: N806
    return isinstance(exc, (ValueError, TypeError, KeyError, TemplateError))


class RenderPort(Protocol):
    # None from a delta job means "not provably exact, send a full job".
    async def __call__(self, job: RenderJob) -> Optional[RenderResult]: ...


# Item references one request may hold (each is a store read).
MAX_ITEM_REFERENCES = 256


def context_too_large(size: int, limit: int) -> ApiError:
    return ApiError(400, f"The conversation holds about {size} bytes of input; the limit is {limit} bytes. "
                         "Start a new conversation or compact it.", param="input", code="context_too_large")


# (item id, tenant) -> the stored item (an `item_reference` input), or None.
ItemLookup = Callable[[str, Optional[str]], Awaitable[Optional[dict[str, Any]]]]


@dataclass
class TurnSettings:
    """The turn driver's slice of the configuration."""

    model_name: str
    default_max_tokens: int
    max_model_len: int
    verify_renders: bool = False
    output_chunk_chars: int = 256
    classify_tool_outputs: bool = False
    max_input_items: Optional[int] = None
    max_context_tokens: Optional[int] = None
    max_context_bytes: Optional[int] = None
    # The engine can force tool calls (tool_choice required/named) for this model's format.
    can_force_tool_calls: bool = True

    @property
    def context_limit(self) -> int:
        # A prompt must leave room for one generated token; an operator may bound it lower.
        return min(self.max_model_len - 1, self.max_context_tokens or self.max_model_len)


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
    ) -> None:
        self.settings = settings
        self._items = items
        self.model_name = settings.model_name
        self._render = render
        self._safety = safety
        # OpenTelemetry: the global (no-op unless `telemetry.setup` ran) unless injected.
        self.tracer = tracer or telemetry.tracer()
        self.metrics = metrics or telemetry.Metrics()
        self.services = TurnServices(engine=engine, metrics=self.metrics, tracer=self.tracer, post_work=post_work)

    def check_model(self, req: ResponsesRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
                type="invalid_request_error",
            )

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
        root = self.tracer.start_span("response.create", context=t.trace_parent, kind=telemetry.SpanKind.SERVER,
                                      start_time=telemetry.ns_at(timing.started))
        tctx = telemetry.context_of(root)
        root.set_attribute("loopserve.transport", t.transport)
        root.set_attribute("gen_ai.request.model", self.model_name)
        root.set_attribute("loopserve.session", telemetry.hash_key(t.session_key))
        if t.parsed_at is not None:
            telemetry.span_between(self.tracer, "parse", tctx, telemetry.ns_at(timing.started),
                                   telemetry.ns_at(t.parsed_at))
        status = "cancelled"  # until a terminal event (or a rejection) says otherwise
        try:
            async for ev in self._run(t, timing, root, tctx):
                if ev["type"] in TERMINAL_EVENTS:
                    status = ev["response"]["status"]
                yield ev
        except ApiError as err:
            root.set_attribute("error.type", err.code or str(err.status))
            root.set_status(telemetry.StatusCode.ERROR, err.message[:200])
            status = "rejected"
            raise
        finally:
            root.set_attribute("loopserve.status", status)
            self.metrics.turn_ended(t.transport, status)
            root.end()

    async def _run(self, t: TurnRequest, timing: TurnTiming, root: Any, tctx: Any) -> AsyncIterator[Event]:
        req, cache, session_key, owner, agent = t.request, t.cache, t.session_key, t.owner, t.agent
        self.check_model(req)
        parent: Optional[ResponseState] = None
        prev_id = req.previous_response_id
        if prev_id:
            parent = cache.get(prev_id)
            if parent is not None and parent.owner != owner:
                parent = None  # another tenant's response: as if it did not exist
            found = "hit" if parent is not None else "miss"
            if parent is None and t.lookup is not None:
                parent = await t.lookup(prev_id)
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
        if parent is not None and parent.affinity_key:
            # Keep the chain on the engine replica that holds its prefix KV.
            session_key = parent.affinity_key
        try:
            prep = await self._prepare(req, parent, timing, tctx, owner)
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
        ctx, rendered, tools_spec, key = prep
        st = self.settings

        # Classify only what no earlier turn classified (new input items); it
        # runs while the engine prefills.
        new_texts = turn_input_texts(ctx.items[ctx.new_start :], req.instructions,
                                     parent.instructions if parent is not None else None,
                                     st.classify_tool_outputs) if self._safety else []
        safety = TurnSafety(self._safety, new_texts, st.output_chunk_chars, tracer=self.tracer, trace_parent=tctx)
        response_id = t.response_id or new_id("resp")
        timing.response_id = response_id
        root.set_attribute("loopserve.response_id", response_id)
        response = build_response(response_id=response_id, model=self.model_name, request=req, previous_response_id=prev_id)
        asm = EventAssembler(response, stream_id=t.stream_id)
        room = st.max_model_len - len(rendered.prompt_token_ids)
        turn = Turn(request=req, response_id=response_id, model=self.model_name, session_key=session_key, owner=owner,
                    parent=parent, context=ctx, rendered=rendered, render_key=key, tools=tools_spec,
                    max_tokens=max(1, min(req.max_output_tokens or st.default_max_tokens, room)), cache=cache,
                    timing=timing, on_state=t.on_state, trace=tctx, include_timing=t.include_timing,
                    stop=t.stop, keep_parent=t.keep_parent, agent=agent, expect_back=t.transport == "websocket")
        if agent is not None:
            async def next_step(state: ResponseState, injected: list[dict[str, Any]]):
                # The next engine call of a multi-agent response: a continuation of `state`
                # (this response after its last step) with the injected tool outputs.
                step_req = req.model_copy(update={"input": parse_request({"input": injected}).input,
                                                  "previous_response_id": response_id})
                step_ctx, step_rendered, _, _ = await self._prepare(step_req, state, TurnTiming(), tctx, owner)
                # max_output_tokens bounds the whole response; the context bounds each call.
                budget = (req.max_output_tokens or st.default_max_tokens) - turn.used[2] - turn.output_tokens
                turn.max_tokens = max(1, min(budget, st.max_model_len - len(step_rendered.prompt_token_ids)))
                return step_ctx, step_rendered

            turn.next_step = next_step
        stream = TurnStream(turn, asm, safety, self.services)
        streaming = self.tracer.start_span("stream_events", context=tctx)
        try:
            events = asm.start()
            timing.first_event = time.perf_counter() - timing.started
            for ev in events:
                yield ev
            async for ev in (stream.warm_up() if req.is_warm_up else stream.generate()):
                yield ev
        finally:
            safety.cancel()
            streaming.end()
            root.set_attribute("gen_ai.usage.input_tokens", turn.prompt_len)
            root.set_attribute("gen_ai.usage.output_tokens", turn.output_tokens)
            root.set_attribute("loopserve.cached_tokens", turn.cached_tokens)
            # Post-inference work is scheduled even when the client went away
            # mid-turn (tokens were spent); never awaited here.
            stream.schedule_post_work()

    async def _truncate(self, ctx: ResolvedContext, job: RenderJob) -> tuple[ResolvedContext, RenderResult]:
        """`truncation: "auto"`: drop the oldest items, whole user turns at a time (a cut at a
        user message never separates a tool call from its output), keeping the instructions,
        until the prompt fits; the response continues from what the model saw. Galloping then
        binary search: O(log turns) full renders, each of about the model's context at most.
        When even the last user turn alone does not fit, the context_length_exceeded error stands."""
        items = ctx.items
        cuts = [i for i, item in enumerate(items)
                if i > 0 and item.get("type", "message") == "message" and item.get("role") == "user"]
        best: Optional[tuple[int, RenderResult]] = None

        async def fits(k: int) -> Optional[RenderResult]:
            rendered = await self._render(job.as_full(items[cuts[k]:]))
            return rendered if len(rendered.assemble(None)[1]) <= self.settings.context_limit else None

        # Galloping from the newest turn back: each render is at most about twice what is kept,
        # so the work is bounded by the model's context, not by how large the body is.
        bad, good, step = -1, len(cuts), 1
        while good > 0:
            k = max(0, len(cuts) - step)
            rendered = await fits(k)
            if rendered is None:
                bad = k
                break
            best, good, step = (cuts[k], rendered), k, step * 2
        lo, hi = bad + 1, good - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            rendered = await fits(mid)
            if rendered is not None:
                best, hi = (cuts[mid], rendered), mid - 1
            else:
                lo = mid + 1
        if best is None:
            rendered = await self._render(job)
            return ctx, rendered
        cut, rendered = best
        return ResolvedContext(items[cut:], max(0, ctx.new_start - cut), ctx.known_call_ids, ctx.pending_call_ids,
                               ctx.parent), rendered

    async def count_input_tokens(self, req: ResponsesRequest, parent: Optional[ResponseState], owner: str) -> int:
        """What `input_tokens` would be for this request (renders, does not generate); item
        references resolve in `owner`'s items only."""
        _, rendered, _, _ = await self._prepare(req, parent, TurnTiming(), None, owner)
        return len(rendered.prompt_token_ids)

    async def _dereference(self, items: list[dict[str, Any]], owner: Optional[str],
                           held: int) -> tuple[list[dict[str, Any]], int]:
        """`item_reference` inputs -> the tenant's stored items (400 when not found). Each distinct
        item is fetched once, and the input's size is summed as it grows: a short body naming one
        large item many times stops at the context limit, not after holding every copy."""
        refs = sum(1 for item in items if item.get("type") == "item_reference")
        if refs > MAX_ITEM_REFERENCES:
            raise ApiError(400, f"Invalid 'input': {refs} item references; at most {MAX_ITEM_REFERENCES} are allowed "
                                "in one request.", param="input", code="array_above_max_length")
        fetched: dict[str, dict[str, Any]] = {}
        out, total = [], 0
        for i, item in enumerate(items):
            if item.get("type") == "item_reference":
                ref = str(item.get("id"))
                found = fetched.get(ref)
                if found is None:
                    # No tenant, no items: a missing owner never stands for anyone's ("default" included).
                    found = await self._items(ref, owner) if self._items is not None and owner else None
                    if found is None:
                        raise ApiError(400, f"Item with id '{ref}' not found.", param=f"input[{i}]",
                                       code="invalid_value")
                    fetched[ref] = found
                item = dict(found)  # stored input and output items render as they are (shallow: shared content)
            total += items_nbytes([item])
            limit = self.settings.max_context_bytes
            if limit is not None and held + total > limit:
                raise context_too_large(held + total, limit)
            out.append(item)
        return out, total

    async def _prepare(self, req: ResponsesRequest, parent: Optional[ResponseState], timing: TurnTiming, tctx,
                       owner: Optional[str] = None):
        t0 = time.perf_counter()
        new_items = req.input_items()
        new_bytes: Optional[int] = None  # summed once: while dereferencing, or below
        if any(item.get("type") == "item_reference" for item in new_items):
            new_items, new_bytes = await self._dereference(new_items, owner,
                                                           parent.context_bytes if parent is not None else 0)
        with self.tracer.start_as_current_span("resolve_context", context=tctx):
            reject_non_text(new_items, self.model_name)
            ctx = resolve_context(new_items, parent)
            limit = self.settings.max_context_bytes
            if limit is not None:
                # Payload the state will keep alive (rendered or not): bounded per context.
                size = (parent.context_bytes if parent is not None else 0) + (
                    new_bytes if new_bytes is not None else items_nbytes(new_items))
                if size > limit:
                    raise context_too_large(size, limit)
            if not ctx.items and not req.is_warm_up:
                raise ApiError(400, "Missing required parameter: 'input'.", param="input",
                               code="missing_required_parameter")
            tools_spec = normalize_tools(req.tools)
            check_output_controls(req, tools_spec, model=self.model_name,
                                  can_force_tool_calls=self.settings.can_force_tool_calls)
            effort = req.reasoning.effort if req.reasoning is not None else None
            key = RenderKey.of(req.instructions, tools_spec, effort)
        timing.resolve = time.perf_counter() - t0
        timing.new_items = len(new_items)
        timing.context_items = len(ctx.items)
        t1 = time.perf_counter()
        st = self.settings
        pre = parent.rendered if parent is not None else None
        full_job = RenderJob(req.instructions, tools_spec, items=ctx.items, reasoning_effort=effort)
        if pre is not None and pre.key == key:
            # Only the anchor message and the new items travel: O(new items).
            job = RenderJob(req.instructions, tools_spec, delta=True, reasoning_effort=effort,
                            anchor_items=ctx.items[pre.anchor_start : pre.item_count],
                            new_items=ctx.items[pre.item_count :], anchor_start=pre.anchor_start,
                            prior=pre.prior if parent.output_start == pre.item_count else None)
            if st.verify_renders:
                job.verify_items, job.verify_prefix = ctx.items, pre.token_ids
        else:
            job = full_job
        span = self.tracer.start_span("render", context=tctx)
        try:
            job.trace = full_job.trace = telemetry.inject(telemetry.context_of(span))
            rendered = await self._render(job)
            if rendered is None:  # the delta was not provably exact: render it all
                rendered = await self._render(full_job)
            span.set_attribute("loopserve.render.mode", "full" if rendered.full else "delta")
            span.set_attribute("loopserve.render.delta_tokens", rendered.delta_tokens)
        finally:
            span.end()
        extends = pre is not None and not rendered.full
        prefix, prompt = rendered.assemble(pre.token_ids if extends else None)
        timing.render = time.perf_counter() - t1
        timing.full_render = rendered.full
        timing.delta_tokens = rendered.delta_tokens
        if len(prompt) > st.context_limit and req.truncation == "auto":
            ctx, rendered = await self._truncate(ctx, full_job)
            prefix, prompt = rendered.assemble(None)
            timing.full_render, extends = True, False
        if len(prompt) > st.context_limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {st.context_limit} tokens, "
                f"but the input has {len(prompt)} tokens.",
                code="context_length_exceeded",
                param="input",
            )
        return ctx, Rendered(prefix, prompt, rendered.anchor_start, extends, rendered.prompt_override is None), \
            tools_spec, key


__all__ = ["TurnDriver", "TurnSettings", "TurnTiming", "RenderPort", "EnginePort", "Rendered", "Turn"]
