"""Typed messages between the turn core, the render deployment and the engine replicas.

Plain dataclasses (slots): cheap to build, cheap to pickle across a Ray handle,
and the only shapes that cross those boundaries. Item payloads (`Item`) are the
Responses API's own JSON items, validated once at the edge (`protocol.requests`).

`TurnProgress` is what a response's event stream has said so far, the one reader of stream
events by type: the turn driver, compaction, the WebSocket session and the HTTP route need the
same few facts from a stream (its response id once created, each output item as it starts, the
final response, an error event), and read them from a `TurnProgress` fed every event, not by
matching event type strings themselves. Type names come from the `openai` package's event types.
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence, Union, get_args

from openai.types.responses import ResponseCreatedEvent, ResponseErrorEvent, ResponseOutputItemAddedEvent

from cluster.core.events import TERMINAL_EVENTS, Event
from cluster.core.generation import Generation
from cluster.protocol.errors import ApiError

Item = dict[str, Any]  # a Responses API input/output item (JSON form)
ToolSpec = dict[str, Any]  # a normalized function tool ({"type": "function", "function": {...}})
TraceCarrier = dict[str, str]  # W3C trace context headers


# -- generated output, parsed (engines/output_parser.py makes these) -------------------


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class ReasoningPiece:
    text: str


@dataclass(frozen=True)
class ToolCallPiece:
    name: str
    arguments: str  # a JSON string


Piece = Union[TextPiece, ReasoningPiece, ToolCallPiece]


# -- render ---------------------------------------------------------------------------


@dataclass(slots=True)
class PriorOutput:
    """The previous turn's generation prompt and what the engine generated after it
    (token ids and their text with special tokens kept): a delta reuses these ids when
    the template renders that output as exactly this text (token-exact continuation)."""

    generation: array
    token_ids: array
    text: str


# A delta whose new items are larger renders off the event loop (a thread, or the RenderActor).
INLINE_RENDER_MAX_BYTES = 32 * 1024


@dataclass(slots=True)
class RenderJob:
    """Render a context (full) or only what follows a cached prefix (delta)."""

    instructions: Optional[str]
    tools: list[ToolSpec]
    delta: bool = False
    items: Sequence[Item] = ()  # full: the whole context
    anchor_items: Sequence[Item] = ()  # delta: the last rendered message ...
    new_items: Sequence[Item] = ()  # ... and the items after it
    anchor_start: int = 0  # delta: index of the anchor in the context
    history_roles: frozenset = frozenset()  # delta: the chat roles of the context before the anchor's end
    prior: Optional[PriorOutput] = None  # delta: new_items starts with the output these tokens are
    reasoning_effort: Optional[str] = None  # the chat template's reasoning-effort argument
    # Tests and debugging: check a delta against a full render of `verify_items`.
    verify_items: Optional[Sequence[Item]] = None
    verify_prefix: Optional[array] = None
    trace: Optional[TraceCarrier] = None
    new_images: bool = False  # delta: the new items hold images (the model's processor reads each)
    new_bytes: int = 0  # delta: payload bytes of `new_items` (what inline rendering would tokenize)

    @property
    def mode(self) -> str:
        return "delta" if self.delta else "full"

    @property
    def inline_ok(self) -> bool:
        """O(new items), and the new items small: cheap enough to run on an event loop that serves
        other sockets and the replica's health checks. Not a new image (the model's processor reads
        it), nor large new items: the tokenizer holds the GIL (~0.65 ms per KB on these CPUs), and
        64 sockets each sending ~1 MB inputs kept a connection replica's loop busy past Serve's
        health-check timeout, which restarted it under every honest socket."""
        return (self.delta and self.verify_items is None and not self.new_images
                and self.new_bytes <= INLINE_RENDER_MAX_BYTES)

    def as_full(self, items: Sequence[Item]) -> "RenderJob":
        return RenderJob(self.instructions, self.tools, items=items, trace=self.trace,
                         reasoning_effort=self.reasoning_effort)


# -- engine ---------------------------------------------------------------------------

@dataclass(slots=True)
class EngineRequest:
    """One generation. The prompt travels whole, or as the tail after the first
    `base_len` tokens of the prompt the same replica ran for `base_request_id`
    (a continuation sends O(new tokens), not its history)."""

    request_id: str
    session_key: str  # routes every turn of a session to the replica holding its KV
    prompt_token_ids: array  # array('i'): the whole prompt, or the tail after the base
    generation: Generation  # what to generate: max tokens, sampling, tools, output format
    # Prefix-cache namespace (one per tenant): a prompt only hits blocks cached
    # under the same salt (vLLM's `cache_salt`).
    cache_salt: Optional[str] = None
    base_request_id: Optional[str] = None
    base_len: int = 0
    trace: Optional[TraceCarrier] = None
    sent_at_ns: int = 0  # wall clock when sent: the replica reports the dispatch time from it
    # The session will very likely send another turn soon (its WebSocket is open): the engine
    # replica keeps its prefix in the KV budget through the pause (`engines/kv/budget.py`).
    expect_back: bool = False
    close_tells_end: bool = False  # its socket's close releases its KV (nothing stored): its end told
    # The chain can be continued (stored, or named by `x-session-id` / `prompt_cache_key`): without
    # another sign it is kept softly, and once it came back it is expected back.
    continuable: bool = False
    # The client reads the output as it comes (a WebSocket, `stream: true`); else one answer at the
    # end, and the engine sends only its first and last pieces (no per-token wakeups on the way).
    streamed: bool = True
    # The retention its client asked for (`prompt_cache_options.ttl`, seconds; 0: none).
    cache_ttl_s: float = 0.0
    # The engine replica the chain's last turn ran on (its prefix is there): placed there again,
    # from any connection replica, while that replica lives (cluster/serve_plugins/kv_router.py).
    placement: str = ""
    # The session was moved once already for lack of KV room (it waits where it is now).
    moved: bool = False
    # Set by the engine replica for its engine (never sent by a connection): keep this
    # request's KV blocks pinned under `kv_pin` for `kv_ttl_s` after it ends, and unpin
    # the sessions in `kv_unpin` (their retention ended) before it is scheduled.
    kv_pin: str = ""
    kv_ttl_s: float = 0.0
    kv_unpin: tuple[str, ...] = ()
    # A vision model's images (encoded files, in prompt order): every image of the whole prompt,
    # a tail's base included (the engine expands each placeholder token of the prompt into its
    # image's tokens), and how many tokens that expansion adds.
    images: tuple[bytes, ...] = ()
    image_tokens: int = 0

    @property
    def engine_len(self) -> int:
        """The prompt's length as the engine counts it (images expanded); a tail's base excluded."""
        return len(self.prompt_token_ids) + self.image_tokens

    @property
    def is_tail(self) -> bool:
        return self.base_request_id is not None

    def with_prompt(self, prompt: array) -> "EngineRequest":
        return replace(self, prompt_token_ids=prompt, base_request_id=None, base_len=0)


@dataclass(slots=True, frozen=True)
class EngineQueued:
    """The turn waits for room in the engine replica's KV budget (sent once, before it starts)."""

    position: int  # turns ahead of it in the replica's queue, plus one
    queued_tokens: int  # tokens waiting in that queue, its own included


@dataclass(slots=True, frozen=True)
class TokenProgress:
    """Tokens generated since the last chunk (a turn stopped early still knows its cost)."""

    n: int


@dataclass(slots=True, frozen=True)
class CoreTimeline:
    """Where a request's time went inside vLLM, from its engine core's own marks (monotonic,
    one clock for the processes of a host): to the core (the front end's input processing and
    the hop), queued in its scheduler, prefill (scheduled to the first token), decode, and back
    (the outputs' hop, detokenizing, up to the replica holding the last one)."""

    to_core_s: float
    queued_s: float
    prefill_s: float
    decode_s: float
    back_s: float


@dataclass(slots=True)
class EngineDone:
    """The end of a generation, with the engine replica's own clock."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: Optional[str]
    replica: str = ""
    engine_s: float = 0.0  # the replica's time for the request
    first_token_s: float = 0.0  # ... to the first output token (prefill)
    dispatch_s: float = 0.0  # from the caller sending the request to the replica starting it
    reasoning_tokens: int = 0
    # The replica's direct channel ("host:port/secret"), on answers that came through the
    # Serve handle: the session's next turns stream from it directly (cluster/engines/channel.py).
    channel: str = ""
    # What was generated: token ids (int32 bytes) and their text with special tokens kept;
    # the next turn's prompt reuses these ids where the template renders them as this text.
    output_ids: bytes = b""
    output_text: str = ""
    # A `CoreTimeline`'s fields in order, from engines that mark their core's steps (vLLM); kept
    # as a sequence of floats: the channel carries pieces of scalars and lists (channel_codec.py).
    core: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        self.core = tuple(self.core)  # msgpack gives lists back

    def core_timeline(self) -> Optional[CoreTimeline]:
        return CoreTimeline(*self.core) if self.core else None

    @property
    def output_token_ids(self) -> array:
        ids = array("i")
        ids.frombytes(self.output_ids)
        return ids


# The engine replica cannot resolve a tail prompt (its base is gone): send the whole prompt.
PROMPT_BASE_MISSING = "prompt_base_missing"
# The engine replica had no KV room for the session for too long: place it elsewhere (once).
KV_MOVE = "kv_session_move"
# The engine replica's queue for KV room (or the tenant's part of it) is full: a 429.
KV_QUEUE_FULL = "kv_queue_full"


@dataclass(slots=True, frozen=True)
class EngineFailure:
    """A request the engine refused (client error) or cannot serve as sent."""

    status: int
    message: str
    code: Optional[str] = None
    param: Optional[str] = None
    retry_after_s: Optional[float] = None  # a 429: when to try again

    def error(self) -> ApiError:
        return ApiError(self.status, self.message, code=self.code, param=self.param, retry_after_s=self.retry_after_s)


EnginePiece = Union[TextPiece, ReasoningPiece, ToolCallPiece, TokenProgress, EngineDone, EngineFailure, EngineQueued]
EngineChunk = list[EnginePiece]  # what one item of an engine replica's stream carries


def done_of(chunk: EngineChunk) -> Optional[EngineDone]:
    """The stream's result if this chunk ends it: EngineDone is always a stream's last piece."""
    last = chunk[-1] if chunk else None
    return last if isinstance(last, EngineDone) else None


def merged(chunks: list[EngineChunk]) -> EngineChunk:
    """Chunks that arrived together as one, in order: adjacent text (or reasoning) pieces joined,
    the token counts summed where the first one was. A consumer that fell behind then sends one
    delta event for what piled up, not one per token (a busy replica's per-event work is what
    keeps it behind)."""
    out: EngineChunk = []
    progress_at = -1
    for chunk in chunks:
        for piece in chunk:
            kind = type(piece)
            if kind is TokenProgress:
                if progress_at < 0:
                    progress_at = len(out)
                    out.append(piece)
                else:
                    out[progress_at] = TokenProgress(out[progress_at].n + piece.n)
                continue
            if kind is TextPiece or kind is ReasoningPiece:
                j = len(out) - 1
                j -= j == progress_at  # the count between two texts does not part them
                if j >= 0 and type(out[j]) is kind:
                    out[j] = kind(out[j].text + piece.text)
                    continue
            out.append(piece)
    return out


def _type_of(event_class: Any) -> str:
    return get_args(event_class.model_fields["type"].annotation)[0]


CREATED, ITEM_ADDED, ERROR = (_type_of(t) for t in (ResponseCreatedEvent, ResponseOutputItemAddedEvent,
                                                    ResponseErrorEvent))


class Milestone(enum.Enum):
    """What one event means to the code that drives a response."""

    CREATED = "created"  # the response exists: `TurnProgress.response_id`
    ITEM_ADDED = "item_added"  # an output item started: `TurnProgress.last_item`
    TERMINAL = "terminal"  # the response ended: `TurnProgress.final`
    ERROR = "error"  # an error event (a failed response's terminal event follows): `TurnProgress.error`
    NONE = "none"  # anything else (deltas, done events, ...)


@dataclass(slots=True)
class TurnProgress:
    response_id: Optional[str] = None
    last_item: Optional[dict[str, Any]] = None
    final: Optional[dict[str, Any]] = None
    error: Optional[Event] = None

    def observe(self, ev: Event) -> Milestone:
        kind = ev["type"]
        if kind == CREATED:
            self.response_id = ev["response"]["id"]
            return Milestone.CREATED
        if kind == ITEM_ADDED:
            self.last_item = ev["item"]
            return Milestone.ITEM_ADDED
        if kind in TERMINAL_EVENTS:
            self.final = ev["response"]
            self.response_id = self.final["id"]
            return Milestone.TERMINAL
        if kind == ERROR:
            self.error = ev
            return Milestone.ERROR
        return Milestone.NONE

    @property
    def status(self) -> Optional[str]:
        """The final response's status (None until a terminal event)."""
        return self.final["status"] if self.final is not None else None


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
    # Inside the engine (vLLM's core marks, `CoreTimeline`): 0 for engines without them.
    engine_core_in: float = 0.0
    engine_core_queued: float = 0.0
    engine_core_prefill: float = 0.0
    engine_core_decode: float = 0.0
    engine_core_out: float = 0.0
    session_moved: bool = False  # the previous turn ran on another engine replica

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "started"}


# The timings' fields a `CoreTimeline` fills, in its fields' order (to core, queued, prefill,
# decode, back).
ENGINE_CORE_TIMINGS = ("engine_core_in", "engine_core_queued", "engine_core_prefill", "engine_core_decode",
                       "engine_core_out")


__all__ = ["Item", "ToolSpec", "TraceCarrier", "RenderJob", "EngineRequest", "TokenProgress", "EngineDone",
           "EngineFailure", "EngineQueued", "EnginePiece", "EngineChunk", "done_of", "PROMPT_BASE_MISSING", "KV_MOVE", "TextPiece", "ReasoningPiece",
           "ToolCallPiece", "Generation", "Milestone", "TurnProgress", "TurnTiming",
           "ENGINE_CORE_TIMINGS"]
