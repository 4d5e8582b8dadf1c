"""One turn (`Turn`), and its streaming part (`TurnStream`): engine output -> events.

`TurnDriver.run` resolves and renders a request into a `Turn`; a `TurnStream`
runs the engine call, releases output only after the input verdict, stops on a
flagged output chunk, commits the new state before the terminal event and
schedules post-inference work. Both talk to the rest of the replica only through
`TurnServices` (typed ports), never through the driver.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from cluster import telemetry
from cluster.core.events import Event, EventAssembler, timing_event, usage_object
from cluster.core.messages import (
    PROMPT_BASE_MISSING,
    EngineChunk,
    EngineDone,
    EngineFailure,
    EngineQueued,
    EngineRequest,
    PriorOutput,
    ReasoningPiece,
    TextPiece,
    TokenProgress,
    ToolCallPiece,
    ToolSpec,
)
from cluster.core.safety.gate import TurnSafety
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.context import ResolvedContext, output_as_context, output_call_ids
from cluster.core.turn.controls import tool_call_limit
from cluster.core.turn.post_work import PostWorkQueue, TurnRecord
from cluster.core.turn.state import RenderedPrefix, RenderKey, ResponseState, items_nbytes
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.requests import ResponsesRequest

log = logging.getLogger("loopserve.turn")

# An engine replica's stream: EngineRequest -> chunks (a Ray handle stream in production).
EnginePort = Callable[[EngineRequest], AsyncIterator[EngineChunk]]


@dataclass
class Rendered:
    prefix_token_ids: array  # the context without generation prompt (cached for the next turn)
    prompt_token_ids: array  # what the engine gets
    anchor_start: int
    # The prefix was extended, not re-rendered: the prompt starts with the parent's prompt.
    extends_parent: bool = False
    prompt_extends_prefix: bool = True  # prompt = prefix + generation prompt


@dataclass
class TurnTiming:
    """Server-side timings of one turn, in seconds (for stats and benchmarks)."""

    response_id: str = ""
    started: float = field(default_factory=time.perf_counter)
    resolve: float = 0.0
    render: float = 0.0
    first_event: float = 0.0
    first_token: float = 0.0
    engine: float = 0.0
    total: float = 0.0
    tool_wait: float = 0.0  # a multi-agent response waiting for injected tool outputs (client time)
    full_render: bool = False
    new_items: int = 0
    context_items: int = 0
    prompt_tokens: int = 0
    prompt_tokens_sent: int = 0  # of them, what travelled to the engine (the rest: its session's base)
    cached_tokens: int = 0
    delta_tokens: int = 0
    safety_input_ms: float = 0.0  # the input check's own duration (it overlaps prefill)
    safety_input_chars: int = 0
    safety_output_chars: int = 0
    engine_replica: str = ""
    engine_inner: float = 0.0  # the engine replica's own time for the request (engine - this = hop cost)
    engine_first_token: float = 0.0  # engine-side time to the first output token (prefill)
    # From the engine call to the replica starting it (router, handle, queue): the rest of
    # `engine - engine_inner` is the way back (the stream's items and its end).
    engine_dispatch: float = 0.0
    session_moved: bool = False  # the previous turn ran on another engine replica

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "started"}


class Stop:
    """Stops a running response from outside it (WebSocket mode): `response.interrupt` ends it
    without its partial output ("interrupted"), `response.steer` with it ("steered")."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: Optional[str] = None

    def set(self, reason: str) -> None:
        if not self.event.is_set():  # the first reason wins
            self.reason = reason
            self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


async def _until(chunks: AsyncIterator[EngineChunk], stop: Optional[asyncio.Event]) -> AsyncIterator[EngineChunk]:
    """The engine's chunks until `stop` is set. One reader task per turn feeds a queue that the
    stop also ends (no task per chunk on the hot path); closing this generator cancels and awaits
    the reader, so the caller's aclose of `chunks` (which aborts the generation) never meets a
    running generator. Close it before `chunks`."""
    if stop is None:
        async for chunk in chunks:
            yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def read() -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait(chunk)
        except Exception as exc:  # noqa: BLE001 - re-raised on the consumer side
            queue.put_nowait(exc)
        queue.put_nowait(end)

    reader = asyncio.ensure_future(read())
    stopper = asyncio.ensure_future(stop.wait())
    stopper.add_done_callback(lambda f: f.cancelled() or queue.put_nowait(end))
    try:
        while (item := await queue.get()) is not end and not stop.is_set():
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        stopper.cancel()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


def cache_salt(tenant: Optional[str]) -> str:
    """The engine's prefix-cache namespace for a tenant (a hash: tenant names stay in this process)."""
    # No tenant is its own namespace: it never shares a prefix with tenant "default".
    name = "loopserve-no-tenant" if tenant is None else f"loopserve-tenant:{tenant}"
    return hashlib.sha256(name.encode()).hexdigest()[:32]


@dataclass
class TurnServices:
    """What a turn reaches outside itself (injected by the composition root)."""

    engine: EnginePort
    metrics: telemetry.Metrics
    tracer: Any
    post_work: Optional[PostWorkQueue] = None


@dataclass
class Turn:
    """One turn: the request resolved against its parent and rendered, then what it produced."""

    request: ResponsesRequest
    response_id: str
    model: str
    session_key: str  # the engine routing key (the chain's affinity key)
    owner: Optional[str]
    parent: Optional[ResponseState]
    context: ResolvedContext
    rendered: Rendered
    render_key: RenderKey
    tools: list[ToolSpec]
    max_tokens: int
    cache: SessionCache
    timing: TurnTiming
    on_state: Optional[Callable[[ResponseState], None]] = None
    trace: Optional[Any] = None  # the turn's trace context (parent of engine and post-work spans)
    include_timing: bool = False  # send Codex's `responsesapi.websocket_timing` event before the terminal one
    stop: Optional[Stop] = None  # set by `response.interrupt` / `response.steer` (WebSocket mode)
    keep_parent: bool = False  # a fork from another WebSocket lane: its failure leaves the parent cached
    expect_back: bool = False  # its socket stays open: the engine keeps the session's prefix through the pause
    # Multi-agent responses (agent.py): the inbox of injected tool outputs, and how the driver
    # prepares the next engine call once a step's calls are answered.
    agent: Optional[Any] = None
    next_step: Optional[Callable[[ResponseState, list], Awaitable[tuple[ResolvedContext, Rendered]]]] = None
    step: int = 0  # engine calls before the current one
    step_output_start: int = 0  # where the current step's output begins in the response's output
    first_span: tuple[int, int] = (0, 0)  # (input_start, output_start) of the first step's context
    used: tuple[int, int, int] = (0, 0, 0)  # input, cached and output tokens of the earlier steps
    # What it produced
    output_tokens: int = 0
    cached_tokens: int = 0
    status: str = "cancelled"  # until a terminal event says otherwise
    state: Optional[ResponseState] = None

    @property
    def prompt_len(self) -> int:
        return len(self.rendered.prompt_token_ids)

    @property
    def engine_id(self) -> str:
        """The engine request id of the current step (each engine call needs its own)."""
        return self.response_id if not self.step else f"{self.response_id}.{self.step}"

    def engine_request(self, *, whole: bool = False) -> EngineRequest:
        """The engine call; a continuation whose prompt extends its parent's sends only the tail."""
        req = self.request
        prompt = self.rendered.prompt_token_ids
        base = self.parent.rendered if self.parent is not None else None
        base_id = base.engine_request_id if base is not None else None
        base_len = len(base.token_ids) if base is not None else 0
        tail = not whole and base_id is not None and self.rendered.extends_parent and base_len < len(prompt)
        return EngineRequest(
            request_id=self.engine_id,
            session_key=self.session_key,
            prompt_token_ids=prompt[base_len:] if tail else prompt,
            max_tokens=self.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            tools=self.tools,
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            text_format=req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text is not None and req.text.format is not None and req.text.format.type != "text" else None,
            # Tenants never share prefix-cache blocks: `cached_tokens` is exact, so a
            # shared cache would let one tenant probe another's prompts.
            cache_salt=cache_salt(self.owner),
            base_request_id=base_id if tail else None,
            base_len=base_len if tail else 0,
            expect_back=self.expect_back,
        )

    def evict_parent(self) -> None:
        """A failed turn: the next try starts from a fresh lookup of its parent."""
        if self.request.previous_response_id and not self.keep_parent:
            self.cache.evict(self.request.previous_response_id)

    def commit(self, output: list[dict[str, Any]], response: dict[str, Any], replica: str = "",
               engine_ran: bool = False, done: Optional[EngineDone] = None) -> ResponseState:
        """The next turn's state, in the cache before the terminal event leaves. `output` is the
        current step's (the whole response's output is in `response`)."""
        state = self.state = self.snapshot(output, response, replica, engine_ran, done)
        self.cache.put(state)
        if self.on_state:
            self.on_state(state)
        return state

    def snapshot(self, output: list[dict[str, Any]], response: dict[str, Any], replica: str = "",
                 engine_ran: bool = False, done: Optional[EngineDone] = None) -> ResponseState:
        """The state after the current step's `output` (the next step's parent)."""
        req, ctx, rendered = self.request, self.context, self.rendered
        out_items = output_as_context(output)
        calls = output_call_ids(output)
        inherited = ctx.parent.context_bytes if ctx.parent is not None else 0
        # The engine replica keeps this turn's prompt: the next one sends only its tail.
        engine_request_id = self.engine_id if engine_ran and rendered.prompt_extends_prefix else None
        prior = None
        if done is not None and done.output_ids and rendered.prompt_extends_prefix:
            prior = PriorOutput(rendered.prompt_token_ids[len(rendered.prefix_token_ids):], done.output_token_ids,
                                done.output_text)
        # A multi-step response's own input and output start where its first step's did.
        input_start, output_start = self.first_span if self.step else (ctx.new_start, len(ctx.items))
        return ResponseState(
            response_id=self.response_id,
            model=self.model,
            items=ctx.items + out_items,
            output_start=output_start,
            instructions=req.instructions,
            tools=list(req.tools or []),
            rendered=RenderedPrefix(self.render_key, len(ctx.items), rendered.prefix_token_ids, rendered.anchor_start,
                                    engine_request_id, prior),
            known_call_ids=ctx.known_call_ids | frozenset(calls),
            pending_call_ids=ctx.pending_call_ids + tuple(calls),
            store=req.store is not False,
            owner=self.owner,
            input_start=input_start,
            affinity_key=self.session_key,
            context_bytes=inherited + items_nbytes(ctx.items[ctx.new_start:]) + items_nbytes(out_items),
            engine_replica=replica,
            response=response,
        )

    def finish_timing(self) -> TurnTiming:
        t = self.timing
        t.total = time.perf_counter() - t.started
        t.prompt_tokens = self.prompt_len
        t.cached_tokens = self.cached_tokens
        return t


@dataclass
class _Step:
    done: Optional[EngineDone] = None
    ended: bool = False


class TurnStream:
    """The streaming part of one turn (after `response.created`)."""

    def __init__(self, turn: Turn, asm: EventAssembler, safety: TurnSafety, services: TurnServices) -> None:
        self.turn, self.asm, self.safety, self.services = turn, asm, safety, services
        self.posted = False
        self.tool_calls = 0  # over the whole response (max_tool_calls)

    def _usage(self, reasoning_tokens: int = 0) -> dict[str, Any]:
        t = self.turn
        inputs, cached, outputs = t.used  # earlier steps of a multi-agent response
        return usage_object(inputs + t.prompt_len, cached + t.cached_tokens, outputs + t.output_tokens,
                            reasoning_tokens)

    def _blocked(self, flag: dict[str, Any]) -> list[Event]:
        # Content filter: end `incomplete`, cache nothing (no continuation of it).
        self.turn.status = "incomplete"
        self.services.metrics.safety_blocked(str(flag.get("stage", "")))
        self.services.metrics.turn_timed(self.turn.finish_timing())
        return self.asm.finish(self._usage(), incomplete_reason="content_filter")

    def _failed(self, err: ApiError) -> list[Event]:
        self.turn.evict_parent()
        self.turn.status = "failed"
        return self.asm.fail(err)

    async def warm_up(self) -> AsyncIterator[Event]:
        """`generate: false`: cache the turn's state and prefill the engine with its prompt (one
        token generated and discarded), so the first real turn finds the context in the
        engine's prefix cache."""
        flag = await self.safety.gate()
        if flag:
            for ev in self._blocked(flag):
                yield ev
            return
        done = await self._prefill() if self.turn.context.items else None
        if done is not None:
            self.turn.cached_tokens = done.cached_tokens
        self.turn.commit([], self.asm.response, done.replica if done else "", engine_ran=done is not None)
        self.turn.status = "completed"
        self.services.metrics.turn_timed(self.turn.finish_timing())
        for ev in self.asm.finish(self._usage()):
            yield ev

    async def _prefill(self) -> Optional[EngineDone]:
        """Run the prompt through the engine for one token (discarded); None if it failed (the
        warm-up still caches the state: a failed prefill costs only the first turn's time)."""
        self.turn.max_tokens = 1
        done = None
        chunks = self._engine_chunks()
        try:
            async for chunk in chunks:
                for piece in chunk:
                    if isinstance(piece, EngineDone):
                        done = piece
                    elif isinstance(piece, EngineFailure):
                        return None
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:  # noqa: BLE001
            log.warning("warm-up prefill failed for %s", self.turn.response_id, exc_info=True)
            return None
        finally:
            await chunks.aclose()
        return done

    async def _engine_chunks(self) -> AsyncIterator[EngineChunk]:
        """The engine's chunks; a tail prompt whose base is gone is resent whole (once)."""
        turn, services = self.turn, self.services
        request = turn.engine_request()
        span = services.tracer.start_span("engine", context=turn.trace, kind=telemetry.SpanKind.CLIENT)
        request.trace = telemetry.inject(telemetry.context_of(span))
        try:
            for attempt in range(2):
                turn.timing.prompt_tokens_sent = len(request.prompt_token_ids)
                request.sent_at_ns = time.time_ns()
                stream = services.engine(request)
                try:
                    async for chunk in stream:
                        if (attempt == 0 and request.is_tail and chunk and isinstance(chunk[0], EngineFailure)
                                and chunk[0].code == PROMPT_BASE_MISSING):
                            break
                        if chunk and isinstance(chunk[-1], EngineDone):
                            span.set_attribute("loopserve.engine.replica", chunk[-1].replica)
                            span.set_attribute("gen_ai.response.time_to_first_token_ms",
                                               1000 * chunk[-1].first_token_s)
                        yield chunk
                    else:
                        return
                finally:
                    await stream.aclose()  # stops (aborts) the engine if we left early
                services.metrics.prompt_resent()
                request = turn.engine_request(whole=True)
                request.trace = telemetry.inject(telemetry.context_of(span))
        finally:
            span.end()

    async def generate(self) -> AsyncIterator[Event]:
        turn, asm, timing = self.turn, self.asm, self.turn.timing
        while True:
            step = _Step()
            async for ev in self._generate_step(step):
                yield ev
            if step.ended:
                return
            done = step.done
            waited = time.perf_counter()
            injected = await self._injected_outputs(done)
            timing.tool_wait += time.perf_counter() - waited
            if turn.stop is not None and turn.stop.is_set():
                for ev in self._stopped(done, discard=turn.stop.reason == "interrupted"):
                    yield ev
                return
            if not injected:
                break
            for ev in asm.add_items(injected):
                yield ev
            try:
                await self._next_step(done, injected)
            except ApiError as err:
                for ev in self._failed(err):
                    yield ev
                return
        timing.engine_replica = done.replica
        parent = turn.parent
        if parent is not None and parent.engine_replica and done.replica and done.replica != parent.engine_replica:
            timing.session_moved = True
            self.services.metrics.session_moved()
        incomplete = "max_output_tokens" if done.finish_reason == "length" else None
        turn.commit(asm.response["output"][turn.step_output_start:], asm.response, done.replica, engine_ran=True,
                    done=done)
        self.services.metrics.turn_timed(turn.finish_timing(), turn.output_tokens)
        turn.status = "incomplete" if incomplete else "completed"
        terminal = asm.finish(self._usage(done.reasoning_tokens), incomplete_reason=incomplete)
        self.schedule_post_work()  # before the terminal event leaves: nothing is lost if the client goes
        if turn.include_timing:
            yield timing_event(turn.timing, stream_id=asm.stream_id)  # after finish_timing above
        for ev in terminal:
            yield ev

    async def _injected_outputs(self, done: EngineDone) -> Optional[list[dict[str, Any]]]:
        """A multi-agent response whose step called client tools: their injected outputs."""
        turn = self.turn
        if turn.agent is None or done.finish_reason == "length":
            return None
        calls = [item["call_id"] for item in self.asm.response["output"][turn.step_output_start:]
                 if item.get("type") == "function_call"]
        if not calls:
            return None
        return await turn.agent.collect(calls, stop=turn.stop.event if turn.stop is not None else None)

    async def _next_step(self, done: EngineDone, injected: list[dict[str, Any]]) -> None:
        """The next engine call of a multi-agent response: its context gains this step's output
        and the injected tool outputs (rendered as a continuation: only those new items)."""
        turn, asm = self.turn, self.asm
        parent = turn.snapshot(asm.response["output"][turn.step_output_start:len(asm.response["output"]) - len(injected)],
                               asm.response, done.replica, engine_ran=True, done=done)
        context, rendered = await turn.next_step(parent, injected)
        if not turn.step:
            turn.first_span = (turn.context.new_start, len(turn.context.items))
        inputs, cached, outputs = turn.used
        turn.used = (inputs + turn.prompt_len, cached + turn.cached_tokens, outputs + turn.output_tokens)
        turn.parent, turn.context, turn.rendered = parent, context, rendered
        turn.step += 1
        turn.step_output_start = len(asm.response["output"])
        turn.cached_tokens = turn.output_tokens = 0

    async def _generate_step(self, step: "_Step") -> AsyncIterator[Event]:
        """One engine call's output as events. Ending the response on the way (failed, blocked,
        stopped) sets `step.ended`; else `step.done` is the engine's result."""
        turn, asm, safety, timing = self.turn, self.asm, self.safety, self.turn.timing
        req = turn.request
        done: Optional[EngineDone] = None
        flag: Optional[dict[str, Any]] = None
        engine_start = time.perf_counter()
        call_limit = tool_call_limit(req)
        chunks = self._engine_chunks()
        stop = turn.stop
        until = _until(chunks, stop.event if stop is not None else None)
        try:
            async for chunk in until:
                for piece in chunk:
                    if isinstance(piece, EngineQueued):  # waiting for room in the engine's KV budget
                        for ev in asm.queued():
                            yield ev
                        continue
                    for ev in asm.resumed():
                        yield ev
                    if isinstance(piece, TokenProgress):
                        turn.output_tokens += piece.n
                        continue
                    if isinstance(piece, EngineDone):
                        done = piece
                        continue
                    if isinstance(piece, EngineFailure):
                        raise piece.error()
                    if stop is not None and stop.is_set():
                        break  # nothing more goes out once stopped (a steer keeps what went out)
                    # An output piece: released only after the input verdict,
                    # and only while no output chunk has been flagged.
                    flag = await safety.gate() or safety.check_output()
                    if flag:
                        break
                    if not timing.first_token:
                        timing.first_token = time.perf_counter() - timing.started
                    if isinstance(piece, TextPiece):
                        events = asm.text(piece.text)
                        safety.on_output(piece.text)
                    elif isinstance(piece, ReasoningPiece):
                        events = asm.reasoning(piece.text)
                        safety.on_output(piece.text)
                    elif isinstance(piece, ToolCallPiece):
                        if call_limit is not None and self.tool_calls >= call_limit:
                            continue
                        self.tool_calls += 1
                        events = asm.tool_call(piece.name, piece.arguments)
                        # Arguments are generated text too (a command, a file's new contents).
                        safety.on_output(f"{piece.name}({piece.arguments})\n")
                    else:
                        continue
                    for ev in events:
                        yield ev
                if flag:
                    break
            if not flag:
                flag = await safety.finish()
        except ApiError as err:
            step.ended = True
            for ev in self._failed(err):
                yield ev
            return
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            log.warning("engine stream failed for %s", turn.response_id, exc_info=True)
            step.ended = True
            for ev in self._failed(server_error("The engine failed while generating this response.")):
                yield ev
            return
        finally:
            await until.aclose()  # first: it may be reading `chunks`
            await chunks.aclose()
        timing.engine += time.perf_counter() - engine_start
        step.ended = True  # unless it ends with a result below
        if stop is not None and stop.is_set() and not flag:
            for ev in self._stopped(done, discard=stop.reason == "interrupted"):
                yield ev
            return
        if done is not None:
            turn.cached_tokens = done.cached_tokens
            turn.output_tokens = done.output_tokens
            timing.engine_inner = done.engine_s
            timing.engine_first_token = done.first_token_s
            timing.engine_dispatch = done.dispatch_s
        if flag:
            for ev in self._blocked(flag):
                yield ev
            return
        if done is None:
            for ev in self._failed(server_error("The engine stream ended without a result.")):
                yield ev
            return
        step.ended, step.done = False, done

    def _stopped(self, done: Optional[EngineDone], *, discard: bool) -> list[Event]:
        """Stopped from outside. `response.interrupt` (Codex, mode discard_partial_items): the
        response ends `incomplete` (reason `interrupted`) with no output; that terminal event is
        the acknowledgement. `response.steer`: it ends `incomplete` (reason `steered`) with the
        output that went out (closed where it stopped). Either way its state stays continuable."""
        turn = self.turn
        if done is not None:
            turn.cached_tokens = done.cached_tokens
        if discard:
            self.asm.discard_output()
        turn.commit(self.asm.response["output"][turn.step_output_start:], self.asm.response,
                    done.replica if done else "", engine_ran=True)
        self.services.metrics.turn_timed(turn.finish_timing(), turn.output_tokens)
        turn.status = "incomplete"
        events = self.asm.finish(self._usage(), incomplete_reason="interrupted" if discard else "steered")
        self.schedule_post_work()
        return events

    def _late_flag(self, flag: dict[str, Any]) -> None:
        if self.turn.state is not None:
            self.turn.state.blocked = flag

    def schedule_post_work(self) -> None:
        t, sf, turn = self.turn.timing, self.safety, self.turn
        t.safety_input_ms, t.safety_input_chars, t.safety_output_chars = (
            sf.input_seconds * 1000, sf.input_chars, sf.output_chars)
        post_work = self.services.post_work
        if self.posted or post_work is None:
            return
        self.posted = True
        resp = self.asm.response
        post_work.schedule(
            TurnRecord(
                response_id=resp["id"],
                model=turn.model,
                owner=turn.owner,
                status=resp["status"] if self.asm.finished else turn.status,
                usage=resp.get("usage") or self._usage(),
                store=turn.request.store is not False,
                response=resp if self.asm.finished else None,
                safety=self.safety.summary(),
                timing=t.as_dict(),
                on_late_flag=self._late_flag,
                state=turn.state,
                trace=turn.trace,
            )
        )
