"""One turn (`Turn`): what the driver resolved and rendered for a request, what the stream
fills in while it runs, and what it commits at the end; with its timings, its stop signal and
the services it reaches outside itself (`TurnServices`, injected)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Optional, Protocol

from cluster import telemetry
from cluster.core.messages import (  # noqa: F401 - TurnTiming: the driver's exports
    EngineChunk,
    EngineDone,
    EngineRequest,
    Generation,
    PriorOutput,
    ToolSpec,
    TurnTiming,
)
from cluster.core.render.chat_messages import item_roles
from cluster.core.turn.cache import RenderedPrefix, RenderKey, ResponseState, SessionCache, items_nbytes
from cluster.core.turn.context import (ResolvedContext, output_as_context, output_call_ids)
from cluster.core.turn.conversation import ConversationPort, Lookup
from cluster.core.turn.mcp_steps import McpPort, McpTurn, without_credentials
from cluster.core.turn.post_work import PostWorkQueue
from cluster.protocol.requests import ResponsesRequest

# An engine replica's stream: (EngineRequest, the turn's Stop or None) -> chunks. A port ends
# its stream as soon as the stop is set (the generation is then aborted like any stream left
# early): the direct channel does so on the queue it already reads, other ports through
# `until_stopped`.
EnginePort = Callable[[EngineRequest, Optional["Stop"]], AsyncIterator[EngineChunk]]


@dataclass
class Rendered:
    """The turn's prompt: the prefix (cached for the next turn) and the generation prompt after it.
    The whole prompt is never joined on the hot path: a continuation sends only its tail, so a turn
    copies the session's history once (the new prefix), not twice."""

    prefix_token_ids: array  # the context without generation prompt (cached for the next turn)
    generation_token_ids: array  # the generation prompt, after the prefix (empty with an override)
    anchor_start: int
    # The prefix was extended, not re-rendered: the prompt starts with the parent's prompt, less its
    # last `retracted` tokens (a template's closing tail the new messages replace).
    extends_parent: bool = False
    # A full render whose prompt is not prefix + generation prompt (no safe cut between them).
    prompt_override: Optional[array] = None
    # A vision model's images in the prompt, in order (each one placeholder token in the ids), and
    # the tokens the engine adds expanding them: the engine's prompt length is len(ids) + this.
    images: tuple[bytes, ...] = ()
    image_tokens: int = 0
    retracted: int = 0

    @property
    def prompt_extends_prefix(self) -> bool:
        return self.prompt_override is None

    @property
    def prompt_len(self) -> int:
        if self.prompt_override is not None:
            return len(self.prompt_override)
        return len(self.prefix_token_ids) + len(self.generation_token_ids)

    def prompt_from(self, start: int = 0) -> array:
        """The engine's prompt from token `start` on (a new array unless it is the override)."""
        if self.prompt_override is not None:
            return self.prompt_override[start:] if start else self.prompt_override
        prefix = self.prefix_token_ids
        if start >= len(prefix):
            return self.generation_token_ids[start - len(prefix) :]
        return (prefix[start:] if start else prefix) + self.generation_token_ids

    @property
    def engine_len(self) -> int:
        """The prompt's length as the engine counts it (a vision model's images expanded)."""
        return self.prompt_len + self.image_tokens


class Stop:
    """Stops a running response from outside it (WebSocket mode): `response.interrupt` ends it
    without its partial output ("interrupted"), `response.steer` with it ("steered")."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: Optional[str] = None
        self._watchers: list[Callable[[], None]] = []

    def set(self, reason: str) -> None:
        if not self.event.is_set():  # the first reason wins
            self.reason = reason
            self.event.set()
            for watcher in list(self._watchers):
                watcher()

    def is_set(self) -> bool:
        return self.event.is_set()

    def watch(self, on_set: Callable[[], None]) -> Callable[[], None]:
        """Call `on_set` (on the loop, at once) when the stop is set; returns the unwatch."""
        self._watchers.append(on_set)
        return lambda: self._watchers.remove(on_set) if on_set in self._watchers else None


class _UntilStopped:
    """`chunks` until `stop` is set, for a stream that cannot end itself on a stop (a Ray handle
    stream, the in-process engine): one reader task feeds a queue that the stop also ends.
    `aclose` cancels and awaits the reader (which closes `chunks`, aborting the generation)."""

    _END = object()

    def __init__(self, chunks: AsyncIterator[EngineChunk], stop: Stop) -> None:
        self.stop = stop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reader = asyncio.ensure_future(self._read(chunks))
        self.unwatch = stop.watch(lambda: self.queue.put_nowait(self._END))

    async def _read(self, chunks: AsyncIterator[EngineChunk]) -> None:
        try:
            async for chunk in chunks:
                self.queue.put_nowait(chunk)
        except Exception as exc:  # noqa: BLE001 - re-raised on the consumer side
            self.queue.put_nowait(exc)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        self.queue.put_nowait(self._END)

    def __aiter__(self) -> "_UntilStopped":
        return self

    async def __anext__(self) -> EngineChunk:
        item = await self.queue.get()
        if item is self._END or self.stop.is_set():
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.unwatch()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


def until_stopped(chunks: AsyncIterator[EngineChunk], stop: Optional[Stop]) -> AsyncIterator[EngineChunk]:
    """`chunks` ending when `stop` is set (`chunks` itself without a stop)."""
    return chunks if stop is None else _UntilStopped(chunks, stop)


def cache_salt(tenant: Optional[str]) -> str:
    """The engine's prefix-cache namespace for a tenant (a hash: tenant names stay in this process)."""
    # No tenant is its own namespace: it never shares a prefix with tenant "default".
    name = "loopserve-no-tenant" if tenant is None else f"loopserve-tenant:{tenant}"
    return hashlib.sha256(name.encode()).hexdigest()[:32]


class StepPreparer(Protocol):
    """What a multi-step response needs of `prepare.TurnPreparer` (which builds on this module)."""

    settings: Any  # prepare.TurnSettings: default_max_tokens, max_model_len

    async def prepare(self, req: ResponsesRequest, parent: Optional[ResponseState], timing: "TurnTiming", tctx: Any,
                      owner: Optional[str] = None) -> tuple: ...


@dataclass
class TurnServices:
    """What a turn reaches outside itself (injected by the composition root)."""

    engine: EnginePort
    metrics: telemetry.Metrics
    tracer: Any
    post_work: Optional[PostWorkQueue] = None
    preparer: Optional["StepPreparer"] = None  # prepares each later engine call of a multi-agent response
    mcp: Optional[McpPort] = None  # the cluster's MCP client (`mcp` tools run by the server)


class ToolOutputInbox(Protocol):
    """A multi-agent response's tool outputs, injected while it runs (websocket/agent.py)."""

    async def collect(self, calls: list[str], stop: Optional[asyncio.Event] = None) -> Optional[list[dict[str, Any]]]: ...


@dataclass
class Steps:
    """A response's engine calls: one for most; a multi-agent response calls the engine again
    each time its `inbox` answers the client tool calls of the step before."""

    inbox: Optional[ToolOutputInbox] = None
    count: int = 0  # engine calls before the current one
    output_start: int = 0  # where the current step's output begins in the response's output
    first_span: tuple[int, int] = (0, 0)  # (input_start, output_start) of the first step's context
    used: tuple[int, int, int] = (0, 0, 0)  # input, cached and output tokens of the earlier steps
    mcp: Optional[McpTurn] = None  # its server-run MCP tools: a step after their calls needs no client


@dataclass
class Turn:
    """One turn: the request resolved against its parent and rendered, then what it produced.
    What the transport handed in (`origin`, with its scope) is held, not copied."""

    origin: "TurnRequest"
    response_id: str
    model: str
    session_key: str  # the engine routing key (the chain's affinity key)
    parent: Optional[ResponseState]
    context: ResolvedContext
    rendered: Rendered
    render_key: RenderKey
    tools: list[ToolSpec]
    max_tokens: int  # the current step's (a step after tool calls gets what is left)
    timing: TurnTiming
    generation: Generation  # the request's, against the model's defaults (its max tokens: `max_tokens`)
    trace: Optional[Any] = None  # the turn's trace context (parent of engine and post-work spans)
    cache_ttl_s: float = 0.0  # the retention its client asked for (`prompt_cache_options.ttl`), as applied
    cache_check: Optional[Any] = None  # `prompt_cache_options.comparison_response_id`: diagnostics.CacheCheck
    steps: Steps = field(default_factory=Steps)
    # What it produced
    output_tokens: int = 0
    cached_tokens: int = 0
    status: str = "cancelled"  # until a terminal event says otherwise
    state: Optional[ResponseState] = None

    @property
    def request(self) -> ResponsesRequest:
        return self.origin.request

    @property
    def owner(self) -> Optional[str]:
        return self.origin.scope.owner

    @property
    def cache(self) -> SessionCache:
        return self.origin.scope.cache

    @property
    def stop(self) -> Optional["Stop"]:
        return self.origin.stop

    @property
    def expect_back(self) -> bool:
        """Its socket stays open: the engine keeps the session's prefix through the pause."""
        return self.origin.scope.transport == "websocket"

    @property
    def prompt_len(self) -> int:
        """The engine's prompt length (a vision model's images expanded)."""
        return self.rendered.engine_len

    @property
    def engine_id(self) -> str:
        """The engine request id of the current step (each engine call needs its own)."""
        step = self.steps.count
        return self.response_id if not step else f"{self.response_id}.{step}"

    def engine_request(self, *, whole: bool = False) -> EngineRequest:
        """The engine call; a continuation whose prompt extends its parent's sends only the tail."""
        req = self.request
        rendered = self.rendered
        base = self.parent.rendered if self.parent is not None else None
        base_id = base.engine_request_id if base is not None else None
        base_len = len(base.token_ids) - rendered.retracted if base is not None else 0
        tail = not whole and base_id is not None and rendered.extends_parent and base_len < rendered.prompt_len
        return EngineRequest(
            request_id=self.engine_id,
            session_key=self.session_key,
            prompt_token_ids=rendered.prompt_from(base_len if tail else 0),
            generation=replace(self.generation, max_tokens=self.max_tokens),
            # Tenants never share prefix-cache blocks: `cached_tokens` is exact, so a
            # shared cache would let one tenant probe another's prompts.
            cache_salt=cache_salt(self.owner),
            base_request_id=base_id if tail else None,
            base_len=base_len if tail else 0,
            expect_back=self.expect_back, close_tells_end=self.expect_back and req.store is False,
            continuable=self.expect_back or req.store is not False or bool(req.prompt_cache_key),
            streamed=self.origin.streamed,
            cache_ttl_s=self.cache_ttl_s,
            placement=self.parent.engine_replica if self.parent is not None else "",
            images=self.rendered.images,
            image_tokens=self.rendered.image_tokens,
        )

    def evict_parent(self) -> None:
        """A failed turn: the next try starts from a fresh lookup of its parent."""
        if self.request.previous_response_id and not self.origin.keep_parent:
            self.cache.evict(self.request.previous_response_id)

    def commit(self, output: list[dict[str, Any]], response: dict[str, Any], replica: str = "",
               engine_ran: bool = False, done: Optional[EngineDone] = None) -> ResponseState:
        """The next turn's state, in the cache before the terminal event leaves. `output` is the
        current step's (the whole response's output is in `response`)."""
        state = self.state = self.snapshot(output, response, replica, engine_ran, done)
        self.cache.put(state)
        on_state = self.origin.scope.on_state
        if on_state is not None:
            on_state(state)
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
            prior = PriorOutput(rendered.generation_token_ids, done.output_token_ids,
                                done.output_text)
        # A multi-step response's own input and output start where its first step's did.
        steps = self.steps
        input_start, output_start = steps.first_span if steps.count else (ctx.new_start, len(ctx.items))
        return ResponseState(
            response_id=self.response_id,
            model=self.model,
            items=ctx.items + out_items,
            output_start=output_start,
            instructions=req.instructions,
            tools=without_credentials(req.tools) if self.steps.mcp is not None else list(req.tools or []),
            rendered=RenderedPrefix(self.render_key, len(ctx.items), rendered.prefix_token_ids, rendered.anchor_start,
                                    engine_request_id, prior, rendered.images, rendered.image_tokens,
                                    self._roles()),
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

    def _roles(self) -> frozenset:
        """The chat roles of the rendered context (the parent's, and the new items', when it extends it)."""
        items = self.context.items
        base = self.parent.rendered if self.parent is not None and self.rendered.extends_parent else None
        if base is None or base.item_count > len(items):
            return item_roles(items)
        return base.roles | item_roles(items[base.item_count:])

    def finish_timing(self) -> TurnTiming:
        t = self.timing
        t.total = time.perf_counter() - t.started
        t.prompt_tokens = self.prompt_len
        t.cached_tokens = self.cached_tokens
        return t


@dataclass(frozen=True)
class TurnScope:
    """What every turn of one connection shares, built once where it opens: a WebSocket, or the
    one HTTP request (a per-connection option is one field here)."""

    cache: SessionCache  # the connection's (WebSocket) or a one-turn cache (HTTP)
    session_key: str  # keeps the session's turns on the engine replica holding its prefix
    transport: str = "http"  # "http" | "websocket"
    owner: Optional[str] = None  # the tenant
    lookup: Optional[Lookup] = None  # a parent not in `cache` (the store, the replica's registry)
    conversations: Optional[ConversationPort] = None  # turns on a conversation (`conversation`)
    on_state: Optional[Callable[[ResponseState], None]] = None  # the new state, before the terminal event
    trace_parent: Any = None  # an incoming `traceparent`: each turn is one span tree under it
    include_timing: bool = False  # send Codex's timing event

    def lookup_for(self, request: ResponsesRequest) -> Optional[Lookup]:
        """Where a parent not in the cache is looked up. WebSocket mode: a `store: false`
        request continues only what its connection holds (docs/protocol.md)."""
        if self.transport == "websocket" and request.store is False:
            return None
        return self.lookup


@dataclass
class TurnRequest:
    """One request for a response: the request, the scope it came on, and what this one carries
    (a per-request option is a field of `ResponsesRequest`, or one here if the wire has none)."""

    request: ResponsesRequest
    scope: TurnScope
    stream_id: Optional[str] = None  # the WebSocket lane, echoed on every event
    response_id: Optional[str] = None  # given in advance (a `response.queued` announced it, or a background start)
    announced: bool = False  # a `response.queued` (its sequence number 0) went out: its events count on from 1
    received_at: Optional[float] = None  # perf_counter when the request arrived (the turn's time counts from it)
    parsed_at: Optional[float] = None
    stop: Optional[Stop] = None  # interrupt or steer
    keep_parent: bool = False  # a failed fork from another lane leaves that lane's response cached
    agent: Optional[ToolOutputInbox] = None  # a multi-agent response's inbox of injected tool outputs

    @property
    def streamed(self) -> bool:
        """Read as it is generated (a socket, or SSE): a plain or background answer is read at its end."""
        return self.scope.transport == "websocket" or bool(self.request.stream)
