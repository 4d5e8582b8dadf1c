"""The streaming part of one turn: engine output -> events, behind the safety gate.

`TurnDriver.run` resolves and renders, then hands over to a `TurnStream`, which
runs the engine call, releases output only after the input verdict, stops on a
flagged output chunk, commits the new state before the terminal event and
schedules post-inference work.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from ..protocol.errors import ApiError, server_error
from .. import telemetry
from .events import Event, EventAssembler, usage_object
from .post_work import TurnRecord
from .safety import TurnSafety


@dataclass
class Rendered:
    prefix_token_ids: array  # the context without generation prompt (cached for the next turn)
    prompt_token_ids: array  # what the engine gets
    anchor_start: int


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
    full_render: bool = False
    new_items: int = 0
    context_items: int = 0
    prompt_tokens: int = 0
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


def last_item_kind(items: list[dict[str, Any]]) -> str:
    for item in reversed(items):
        kind = item.get("type", "message")
        if kind == "message":
            return "user" if item.get("role") in ("user", "system", "developer") else "assistant"
        if kind == "function_call_output":
            return "tool"
        if kind == "function_call":
            return "assistant"
    return "none"


def cache_salt(tenant: Optional[str]) -> str:
    """The engine's prefix-cache namespace for a tenant (a hash: tenant names stay in this process)."""
    return hashlib.sha256(f"loopserve-tenant:{tenant or 'default'}".encode()).hexdigest()[:32]


class TurnStream:
    """The streaming part of one turn (after `response.created`)."""

    def __init__(self, driver: Any, req, cache, ctx, rendered: Rendered, key, owner, session_key, parent,
                 asm: EventAssembler, safety: TurnSafety, timing: TurnTiming, on_state) -> None:
        self.d, self.req, self.cache, self.ctx, self.rendered, self.key = driver, req, cache, ctx, rendered, key
        self.owner, self.session_key, self.parent, self.asm = owner, session_key, parent, asm
        self.safety, self.timing, self.on_state = safety, timing, on_state
        self.prompt_len = len(rendered.prompt_token_ids)
        self.output_tokens = 0
        self.cached = 0
        self.status = "cancelled"
        self.posted = False
        self.state = None
        self.trace = None  # the turn's trace context (parent of engine and post-work spans)

    def _evict_parent(self) -> None:
        if self.req.previous_response_id:
            self.cache.evict(self.req.previous_response_id)

    def _commit(self, output: list[dict[str, Any]], replica: str = "") -> None:
        # The next turn's state is in the cache before the terminal event leaves.
        state = self.d._state(self.asm.response["id"], self.req, self.ctx, output, self.rendered, self.key,
                              self.owner, self.session_key)
        state.engine_replica = replica
        state.response = self.asm.response
        self.state = state
        self.cache.put(state)
        if self.on_state:
            self.on_state(state)

    def _blocked(self, flag: dict[str, Any]) -> list[Event]:
        # Content filter: end `incomplete`, cache nothing (no continuation of it).
        self.status = "incomplete"
        self.d.blocked_turns += 1
        self.d.metrics.safety_blocks.add(1, {"stage": str(flag.get("stage", ""))})
        self.d._record(self.timing, self.prompt_len, self.cached)
        return self.asm.finish(usage_object(self.prompt_len, self.cached, self.output_tokens),
                               incomplete_reason="content_filter")

    async def warm_up(self) -> AsyncIterator[Event]:
        flag = await self.safety.gate()
        if flag:
            for ev in self._blocked(flag):
                yield ev
            return
        self._commit([])
        self.status = "completed"
        self.d._record(self.timing, self.prompt_len, 0)
        for ev in self.asm.finish(usage_object(self.prompt_len, 0, 0)):
            yield ev

    async def generate(self, tools_spec: list[dict[str, Any]]) -> AsyncIterator[Event]:
        d, req, timing, asm, safety = self.d, self.req, self.timing, self.asm, self.safety
        room = d.max_model_len - self.prompt_len
        engine_req = {
            "request_id": asm.response["id"],
            "session_key": self.session_key,
            # Tenants never share prefix-cache blocks: `cached_tokens` is exact, so a
            # shared cache would let one tenant probe another's prompts.
            "cache_salt": cache_salt(self.owner),
            "prompt_token_ids": self.rendered.prompt_token_ids,
            "max_tokens": max(1, min(req.max_output_tokens or d.default_max_tokens, room)),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": tools_spec,
            "tool_choice": req.tool_choice,
            "last_item": last_item_kind(self.ctx.items),
        }
        done: Optional[dict[str, Any]] = None
        flag: Optional[dict[str, Any]] = None
        engine_start = time.perf_counter()
        tool_calls = 0
        span = d.tracer.start_span("engine", context=self.trace, kind=telemetry.SpanKind.CLIENT)
        carrier = telemetry.inject(telemetry.context_of(span))
        if carrier:
            engine_req["trace"] = carrier
        engine_req["sent_at_ns"] = time.time_ns()  # the replica reports the dispatch time from it
        stream = d._engine(engine_req)
        try:
            async for chunk in stream:
                for piece in chunk:
                    kind = piece["t"]
                    if kind == "tokens":
                        self.output_tokens += piece["n"]
                        continue
                    if kind == "done":
                        done = piece
                        continue
                    if kind == "error":
                        raise ApiError(piece["status"], piece["message"], code=piece.get("code"), param=piece.get("param"))
                    # An output piece: released only after the input verdict,
                    # and only while no output chunk has been flagged.
                    flag = await safety.gate() or safety.check_output()
                    if flag:
                        break
                    if not timing.first_token:
                        timing.first_token = time.perf_counter() - timing.started
                    if kind == "text":
                        events = asm.text(piece["v"])
                        safety.on_output(piece["v"])
                    elif kind == "reasoning":
                        events = asm.reasoning(piece["v"])
                        safety.on_output(piece["v"])
                    elif kind == "tool":
                        if req.max_tool_calls is not None and tool_calls >= req.max_tool_calls:
                            continue
                        tool_calls += 1
                        events = asm.tool_call(piece["name"], piece["args"])
                        # Arguments are generated text too (a command, a file's new contents).
                        safety.on_output(f"{piece['name']}({piece['args']})\n")
                    else:
                        continue
                    for ev in events:
                        yield ev
                if flag:
                    break
            if not flag:
                flag = await safety.finish()
        except ApiError as err:
            self._evict_parent()
            self.status = "failed"
            for ev in asm.fail(err):
                yield ev
            return
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            self._evict_parent()
            self.status = "failed"
            for ev in asm.fail(server_error("The engine failed while generating this response.")):
                yield ev
            return
        finally:
            await stream.aclose()  # stops (aborts) the engine if we left early
            if done is not None:
                span.set_attribute("loopserve.engine.replica", str(done.get("replica", "")))
                span.set_attribute("gen_ai.response.time_to_first_token_ms", 1000 * float(done.get("first_token_s", 0.0)))
            span.end()
        timing.engine = time.perf_counter() - engine_start
        if done is not None:
            self.cached = int(done.get("cached_tokens", 0))
            self.output_tokens = int(done.get("output_tokens", self.output_tokens))
            timing.engine_inner = float(done.get("engine_s", 0.0))
            timing.engine_first_token = float(done.get("first_token_s", 0.0))
            timing.engine_dispatch = float(done.get("dispatch_s", 0.0))
        if flag:
            for ev in self._blocked(flag):
                yield ev
            return
        if done is None:
            self._evict_parent()
            self.status = "failed"
            for ev in asm.fail(server_error("The engine stream ended without a result.")):
                yield ev
            return
        timing.engine_replica = replica = str(done.get("replica") or "")
        parent = self.parent
        if parent is not None and parent.engine_replica and replica and replica != parent.engine_replica:
            timing.session_moved = True
            d.session_moves += 1
        usage = usage_object(self.prompt_len, self.cached, self.output_tokens, int(done.get("reasoning_tokens", 0)))
        incomplete = "max_output_tokens" if done.get("finish_reason") == "length" else None
        self._commit(asm.response["output"], replica)
        d._record(timing, self.prompt_len, self.cached, self.output_tokens)
        self.status = "incomplete" if incomplete else "completed"
        terminal = asm.finish(usage, incomplete_reason=incomplete)
        self.schedule_post_work()  # before the terminal event leaves: nothing is lost if the client goes
        for ev in terminal:
            yield ev

    def _late_flag(self, flag: dict[str, Any]) -> None:
        if self.state is not None:
            self.state.blocked = flag

    def schedule_post_work(self) -> None:
        t, sf = self.timing, self.safety
        t.safety_input_ms, t.safety_input_chars, t.safety_output_chars = (
            sf.input_seconds * 1000, sf.input_chars, sf.output_chars)
        if self.posted or self.d.post_work is None:
            return
        self.posted = True
        resp = self.asm.response
        self.d.post_work.schedule(
            TurnRecord(
                response_id=resp["id"],
                model=self.d.model_name,
                owner=self.owner,
                status=resp["status"] if self.asm.finished else self.status,
                usage=resp.get("usage") or usage_object(self.prompt_len, self.cached, self.output_tokens),
                store=self.req.store is not False,
                response=resp if self.asm.finished else None,
                safety=self.safety.summary(),
                timing=self.timing.as_dict(),
                on_late_flag=self._late_flag,
                state=self.state,
                trace=self.trace,
            )
        )
