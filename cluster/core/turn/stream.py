"""The streaming part of one turn (`TurnStream`): engine output -> events.

`TurnDriver.run` resolves and renders a request into a `Turn` (turn.py); a `TurnStream`
runs the engine call, releases output only after the input verdict, stops on a
flagged output chunk, commits the new state before the terminal event and
schedules post-inference work. Both talk to the rest of the replica only through
`TurnServices` (typed ports), never through the driver.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from cluster import telemetry
from cluster.core.events import Event, EventAssembler, timing_event, usage_object
from cluster.core.messages import (ENGINE_CORE_TIMINGS, PROMPT_BASE_MISSING, EngineChunk, EngineDone, EngineFailure,
                                   EngineQueued, ReasoningPiece, TextPiece, TokenProgress, ToolCallPiece, done_of)
from cluster.core.safety.gate import TurnSafety, item_texts
from cluster.core.turn.cache_diagnostics import diagnostics
from cluster.core.turn.controls import tool_call_limit
from cluster.core.turn import steps
from cluster.core.turn.post_work import TurnRecord
from cluster.core.turn.turn import Turn, TurnServices
from cluster.protocol.errors import ApiError, server_error

# Tokens a prefix hit may fall short of the whole reusable prefix: the last block (a CPU engine's
# blocks are 128 tokens) and the last token, which the engine computes again.
DIAGNOSTICS_BLOCK_SLACK = 256

log = logging.getLogger("loopserve.turn")


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
        inputs, cached, outputs = t.steps.used  # earlier steps of a multi-agent response
        return usage_object(inputs + t.prompt_len, cached + t.cached_tokens, outputs + t.output_tokens,
                            reasoning_tokens)

    def _blocked(self, flag: dict[str, Any]) -> list[Event]:
        # Content filter: end `incomplete` with no output (what was released before the verdict
        # is not kept: the final, stored or background response never carries flagged text),
        # cache nothing (no continuation of it).
        self.asm.discard_output()
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
                stream = services.engine(request, turn.stop)
                # Made now, the input check's task runs after the one sending the request (a port's
                # reader task was made already; a bare stream sends it before it first waits).
                self.safety.start_input()
                try:
                    async for chunk in stream:
                        if (attempt == 0 and request.is_tail and chunk and isinstance(chunk[0], EngineFailure)
                                and chunk[0].code == PROMPT_BASE_MISSING):
                            break
                        done = done_of(chunk)
                        if done is not None:
                            span.set_attribute("loopserve.engine.replica", done.replica)
                            span.set_attribute("gen_ai.response.time_to_first_token_ms", 1000 * done.first_token_s)
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
            mcp = turn.steps.mcp
            if mcp is not None and (mcp.running or mcp.refused):  # its server-run calls, awaited
                for ev in await mcp.settle(asm, turn.steps.output_start):
                    yield ev
                if mcp.continues(asm.response["output"][turn.steps.output_start:]) and not (
                        turn.stop is not None and turn.stop.is_set()):
                    if self.services.preparer.settings.classify_tool_outputs:  # as a client's tool outputs are
                        self.safety.add_input(item_texts(asm.response["output"][turn.steps.output_start:], True))
                    try:  # no client round trip: the results go into the next engine call
                        await steps.after_mcp_calls(turn, asm, self.services.preparer, done)
                    except ApiError as err:
                        for ev in self._failed(err):
                            yield ev
                        return
                    continue
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
                await steps.after_injected(turn, asm, self.services.preparer, done, injected)
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
        turn.commit(asm.response["output"][turn.steps.output_start:], asm.response, done.replica, engine_ran=True,
                    done=done)
        self.services.metrics.turn_timed(turn.finish_timing(), turn.output_tokens)
        turn.status = "incomplete" if incomplete else "completed"
        if turn.cache_check is not None:
            asm.response["prompt_cache_diagnostics"] = diagnostics(
                turn.cache_check, turn.rendered.prefix_token_ids, done.prompt_tokens, done.cached_tokens,
                block_size=DIAGNOSTICS_BLOCK_SLACK)
        terminal = asm.finish(self._usage(done.reasoning_tokens), incomplete_reason=incomplete)
        self.schedule_post_work()  # before the terminal event leaves: nothing is lost if the client goes
        if turn.origin.scope.include_timing:
            yield timing_event(turn.timing, stream_id=asm.stream_id)  # after finish_timing above
        for ev in terminal:
            yield ev

    async def _injected_outputs(self, done: EngineDone) -> Optional[list[dict[str, Any]]]:
        """A multi-agent response whose step called client tools: their injected outputs."""
        turn = self.turn
        if turn.steps.inbox is None or done.finish_reason == "length":
            return None
        calls = [item["call_id"] for item in self.asm.response["output"][turn.steps.output_start:]
                 if item.get("type") == "function_call"]
        if not calls:
            return None
        return await turn.steps.inbox.collect(calls, stop=turn.stop.event if turn.stop is not None else None)

    async def _generate_step(self, step: "_Step") -> AsyncIterator[Event]:
        """One engine call's output as events. Ending the response on the way (failed, blocked,
        stopped) sets `step.ended`; else `step.done` is the engine's result."""
        turn, asm, safety, timing = self.turn, self.asm, self.safety, self.turn.timing
        req = turn.request
        done: Optional[EngineDone] = None
        flag: Optional[dict[str, Any]] = None
        engine_start = time.perf_counter()
        call_limit = tool_call_limit(req)
        chunks = self._engine_chunks()  # ends when the turn's stop is set (the port sees to it)
        stop = turn.stop
        try:
            async for chunk in chunks:
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
                    # An output piece: released only after the input verdict, while no
                    # output chunk has been flagged, in parts the unverified bound admits.
                    for ev in await self._release(piece, call_limit):
                        yield ev
                    flag = safety.flag
                    if flag:
                        break
                if flag or done is not None:
                    break  # EngineDone is the engine's last word: its stream's end is not waited for
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
            for name, seconds in zip(ENGINE_CORE_TIMINGS, done.core):  # none from engines without marks
                setattr(timing, name, seconds)
        if flag:
            for ev in self._blocked(flag):
                yield ev
            return
        if done is None:
            for ev in self._failed(server_error("The engine stream ended without a result.")):
                yield ev
            return
        step.ended, step.done = False, done

    async def _release(self, piece: Any, call_limit: Optional[int]) -> list[Event]:
        """One output piece's events. A piece can be thousands of characters (what piled up
        behind a consumer that fell behind, a plain answer's last piece): it is cut into parts
        no larger than a classifier chunk, each taken once the text before it is verified enough
        (`TurnSafety.release_check`); a flag keeps the parts from there on. A tool call goes out
        whole once its arguments' parts pass. (A list, not a generator: one layer less per piece.)"""
        safety, asm = self.safety, self.asm
        events: list[Event] = []
        if isinstance(piece, ToolCallPiece):
            if call_limit is not None and self.tool_calls >= call_limit:
                return events
            # Arguments are generated text too (a command, a file's new contents).
            for part in safety.parts(f"{piece.name}({piece.arguments})\n"):
                if await safety.release_check(len(part)):
                    return events
                safety.on_output(part)
            self.tool_calls += 1
            self._first_token()
            mcp = self.turn.steps.mcp  # a server's tool: an `mcp_call` run now (or an approval request)
            return (mcp is not None and mcp.released(asm, piece.name, piece.arguments)) or \
                asm.tool_call(piece.name, piece.arguments)
        if isinstance(piece, TextPiece):
            emit = asm.text
        elif isinstance(piece, ReasoningPiece):
            emit = asm.reasoning
        else:
            return events
        for part in safety.parts(piece.text):
            if await safety.release_check(len(part)):
                break
            self._first_token()
            events += emit(part)
            safety.on_output(part)
        return events

    def _first_token(self) -> None:
        timing = self.turn.timing
        if not timing.first_token:
            timing.first_token = time.perf_counter() - timing.started

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
        turn.commit(self.asm.response["output"][turn.steps.output_start:], self.asm.response,
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
