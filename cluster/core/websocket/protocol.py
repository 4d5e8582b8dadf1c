"""WebSocket mode's per-connection rules as a state machine without I/O (docs/protocol.md).

Frames and lane progress go in, with the time they happened; actions come out (send this
event, send this error, run this lane, close). The asyncio session (`session.py`) performs
the actions: it owns the tasks, the timer and the socket, and decides nothing.

What the rules are:
- Frames are handled in arrival order. A `response.create` goes to the lane its `stream_id`
  names (none: the connection's default lane); each lane is FIFO, lanes run concurrently, at
  most `MAX_ACTIVE` responses at once; at most `MAX_LANES` named lanes exist at a time. A create
  that has to wait is announced with `response.queued`.
- A frame's error keeps its place: it goes out on the default lane after the responses queued
  before it (a client without lanes must not read it as the failure of the response in flight).
- `response.interrupt`, `response.steer` and `response.inject` act on a response in flight at
  once (`inflight.py` holds their bookkeeping).
- Everything a client can make the connection hold is bounded: creates waiting on lanes and
  errors waiting to be sent count against `max_queued_creates` and `max_queued_bytes`; a
  client that sends invalid frames faster than it reads their errors is closed with 1008.
- The connection ends after `max_connection_seconds`, after `idle_timeout_seconds` without
  activity, or when the server drains; a response in flight finishes first.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from typing import Any, Callable, Optional, Union

from cluster.config import WebSocketConfig
from cluster.core.events import Event
from cluster.core.messages import Milestone
from cluster.core.turn.cache import SessionCache
from cluster.core.websocket import steering
from cluster.core.websocket.actions import (  # noqa: F401 - the session's and tests' one import of them
    Action,
    Close,
    DeferredError,
    End,
    Enqueued,
    RunLane,
    SendError,
    SendEvent,
    closing,
)
from cluster.core.websocket.agent import AgentInbox
from cluster.core.websocket.inflight import InFlight, Lane, ReplicaHeld, WsCreate, create_body, queued_event
from cluster.protocol.errors import ApiError
from cluster.protocol.request_bounds import (MinuteBudget, ReplicaQueue, frame_bytes, frame_too_large, frame_type,
                                             json_bounds, load_event, peek_create)
from cluster.protocol.requests import ResponsesRequest, multi_agent_enabled

IGNORED_TYPES = frozenset({"response.processed", "response.append"})
MAX_ACTIVE = 16  # responses running at once on one connection
MAX_LANES = 32  # named lanes (stream_id) at once on one connection
SETTLE_LAST = 8  # a closing socket's newest responses whose store writes the close waits for
# A frame this large counts against its key's rate limit before it is parsed (parsing holds the
# event loop ~25 ms a MB); a create counted so is not counted again when it starts.
ADMIT_BEFORE_PARSE_BYTES = 64 * 1024
# A create that waits and holds more than this parsed waits as its frame (WsCreate.frame).
HOLD_AS_FRAME_BYTES = 256 * 1024
_STREAM_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,256}$")


class State(enum.Enum):
    OPEN = "open"  # taking frames
    ENDING = "ending"  # limit reached, idle or draining: frames are dropped, responses in flight finish
    CLOSED = "closed"  # the closing error and close frame are out (or the client left)


class WebSocketProtocol:
    def __init__(self, config: WebSocketConfig, *, model_name: str, max_input_items: Optional[int],
                 cache: SessionCache, now: float, sampling: Optional[dict[str, float]] = None,
                 replica_queue: Optional[ReplicaQueue] = None, admit: Optional[Callable[[int], None]] = None,
                 replica_held: Optional[ReplicaHeld] = None, charge: Optional[Callable[[int], None]] = None) -> None:
        self.config = config
        self.model_name = model_name
        self.sampling = sampling or {}  # the model's sampling defaults (a queued response reports them)
        self.max_input_items = max_input_items
        self.cache = cache  # the connection's responses (steers and injects read their state)
        self.state = State.OPEN
        self.end: Optional[End] = None
        self.inflight = InFlight(replica_held)
        self.lanes: dict[str, Lane] = {}  # "" = the default lane
        self.queued_bytes = 0  # creates waiting on their lanes (parsed) and errors waiting to be sent
        self.replica_queue = replica_queue if replica_queue is not None else ReplicaQueue(1 << 62)
        self.admit = admit  # the key's rate limits, told the frame's bytes (raises its 429)
        self.charge = charge or (lambda nbytes: None)  # the key's input bytes alone (raises its 429)
        self._answer_bytes = 0  # errors and failure events the frame being handled made
        self._answers = MinuteBudget(config.max_error_bytes_per_minute, now)
        self._frames = MinuteBudget(config.max_frame_bytes_per_minute, now)
        self.waiting_creates = 0
        self.deferred_errors = 0
        self.started_at = now
        self.last_activity = now
        # The newest responses that ended: every server close sends the client to reconnect, maybe
        # to a replica that reads its `previous_response_id` from the store, so a close first
        # waits for these to be stored (the session's `settle`).
        self.finished: deque[str] = deque(maxlen=SETTLE_LAST)
        # A response of this socket was stored (`store: true`): another connection may continue
        # it, so closing this one must not free the session's engine KV.
        self.stored = False

    # -- frames -----------------------------------------------------------------------
    def receive(self, data: Union[str, bytes], now: float, received_at: Optional[float] = None) -> list[Action]:
        if self.state is not State.OPEN:
            return []  # closed, or ending: the connection takes nothing more
        self._answer_bytes = 0
        actions = self._receive(data, now, received_at)
        # What this frame made the server say back without a turn: errors, and failed steers and
        # injects (which return the client's input). Under Serve's Python proxy a send never
        # blocks, so "errors waiting to be read" never fills; this budget holds whatever the
        # ingress does.
        for action in actions:
            if isinstance(action, SendError):
                self._answer_bytes += 256 + len(action.error.message)
            elif isinstance(action, SendEvent) and str(action.event.get("type", "")).endswith(".failed"):
                self._answer_bytes += 256 + frame_bytes(data)
        if self._answer_bytes and self.state is State.OPEN and not self._answers.spend(self._answer_bytes, now):
            return self._close(End.FLOOD)
        return actions

    def _receive(self, data: Union[str, bytes], now: float, received_at: Optional[float]) -> list[Action]:
        cfg = self.config
        if self.deferred_errors >= cfg.max_queued_creates:
            # Invalid frames faster than their errors are read: nothing more is held for this client.
            return self._close(End.FLOOD)
        if self.waiting_creates + self.deferred_errors >= cfg.max_queued_creates:
            return [SendError(ApiError(429, "Too many queued requests on this connection.", code="rate_limit_exceeded"))]
        self.last_activity = now
        size = frame_bytes(data)
        if size > cfg.max_frame_bytes:  # never parsed nor held; its error keeps its FIFO place
            return self._defer(frame_too_large(size, cfg.max_frame_bytes))
        if self.queued_bytes + size > cfg.max_queued_bytes:
            return [SendError(ApiError(
                429, f"Too many bytes queued on this connection (limit {cfg.max_queued_bytes}); wait for the "
                     "responses in flight.", code="rate_limit_exceeded"))]
        # Every frame is paid for before it is read: the socket's bucket, then the key's
        # window (a large frame as a request too: it is not counted again when it starts).
        try:
            self._frames.take(size, now) or self._frames.refuse(size, "bytes of frames on this connection")
            kind = frame_type(data)
            admitted = kind not in IGNORED_TYPES and size > ADMIT_BEFORE_PARSE_BYTES and self.admit is not None
            (self.admit if admitted else self.charge)(size)
        except ApiError as err:
            return [SendError(err)]  # nothing held: the frame is dropped at once
        if kind in IGNORED_TYPES:
            return []  # dropped unparsed: building what nobody reads cost ~15x a create's byte budget
        too_complex, held = json_bounds(data)
        if too_complex is not None:
            return self._defer(too_complex)
        if size > ADMIT_BEFORE_PARSE_BYTES:
            body = peek_create(data)
            if body is not None and self._waits(body.get("stream_id")):
                return self._enqueue(body, 0, received_at, admitted, data, peeked=True)  # parsed when its lane starts it
        try:
            event, _ = load_event(data, counted=True)  # steers and injects too are bounded before anything holds them
        except ApiError as err:
            return self._defer(err)
        # Counted as what the parsed event holds (~10x a frame of small items), not the frame.
        return self._event(event, held, received_at, admitted, data)

    def _event(self, event: Event, nbytes: int, received_at: Optional[float], admitted: bool = False,
               frame: Union[str, bytes, None] = None) -> list[Action]:
        kind = event["type"]
        if kind in IGNORED_TYPES:
            return []
        # Events acting on a response in flight: answered at once, never queued behind it.
        if kind == "response.interrupt":
            # A response announced as queued (or starting) stops too, as soon as it starts.
            err = self.inflight.interrupt(event, [*self.queued(), *self.starting()])
            return self._defer(err) if err is not None else []
        if kind in ("response.steer", "response.inject"):
            try:
                events = (self.inflight.steer(event, self.cache, self.queued()) if kind == "response.steer"
                          else self.inflight.inject(event, self.cache))
            except ApiError as err:
                return self._defer(err)
            return [SendEvent(ev) for ev in events]
        if kind != "response.create":
            return self._defer(ApiError(
                400, f"Invalid event type '{kind}'. Supported: 'response.create', 'response.steer', "
                     "'response.interrupt', 'response.inject'.", param="type", code="invalid_value"))
        return self._enqueue(create_body(event), nbytes, received_at, admitted, frame)

    def _enqueue(self, body: dict[str, Any], nbytes: int, received_at: Optional[float],
                 admitted: bool = False, frame: Union[str, bytes, None] = None, peeked: bool = False) -> list[Action]:
        stream_id = body.get("stream_id")
        if stream_id is not None and not (isinstance(stream_id, str) and _STREAM_ID.match(stream_id)):
            return self._defer(ApiError(400, "stream_id must be 1-256 characters of [A-Za-z0-9_.-].",
                                        param="stream_id", code="invalid_stream_id"))
        key = stream_id or ""
        if key not in self.lanes and key and sum(1 for k in self.lanes if k) >= MAX_LANES:
            return self._defer(ApiError(
                400, f"This connection already has {MAX_LANES} active stream_id lanes; wait for one to finish.",
                param="stream_id", code="websocket_stream_limit_reached"), stream_id=stream_id)
        waits = self._waits(key)
        as_frame = waits and frame is not None and (peeked or nbytes > HOLD_AS_FRAME_BYTES)
        if as_frame:
            nbytes = 2 * frame_bytes(frame)  # the frame, and the ids kept beside it (a part of it)
        if waits and self.queued_bytes + nbytes > self.config.max_queued_bytes:
            return [SendError(ApiError(
                429, f"This request holds {nbytes} bytes parsed; with what waits on this connection that is over "
                     f"its limit ({self.config.max_queued_bytes}). Wait for the responses in flight.",
                code="rate_limit_exceeded"), stream_id)]
        if not self.replica_queue.take(nbytes):
            return [SendError(ApiError(
                429, "This server has too many requests waiting on its connections; retry shortly.",
                code="rate_limit_exceeded", retry_after_s=1.0), stream_id)]
        size = frame_bytes(frame) if frame is not None else 0
        create = WsCreate(body, received_at, stream_id, nbytes=nbytes, admitted=admitted,
                          large=size > ADMIT_BEFORE_PARSE_BYTES, size=size)
        announce = queued_event(create, self.model_name, self.sampling, self.max_input_items) if waits else None
        if as_frame:  # only what the waiting needs stays parsed: the parent it continues
            create.body = {k: body[k] for k in ("previous_response_id",) if k in body}
            create.frame = frame
        lane = self._lane(key)
        lane.pending.append(create)
        self.queued_bytes += nbytes
        self.waiting_creates += 1
        return [Enqueued(create, announce), RunLane(key)]

    def _waits(self, stream_id: Any) -> bool:
        """Whether a create on this lane would wait: each lane with creates holds (or waits for)
        one of the MAX_ACTIVE slots."""
        existing = self.lanes.get(stream_id or "") if isinstance(stream_id, (str, type(None))) else None
        return (existing is not None and existing.has_creates) or \
            sum(1 for other in self.lanes.values() if other.has_creates) >= MAX_ACTIVE

    def _defer(self, err: ApiError, stream_id: Optional[str] = None) -> list[Action]:
        deferred = DeferredError(err, stream_id)
        self._answer_bytes += deferred.nbytes
        self.deferred_errors += 1
        self.queued_bytes += deferred.nbytes
        self._lane("").pending.append(deferred)
        return [RunLane("")]

    # -- lanes ------------------------------------------------------------------------
    def next_on_lane(self, key: str) -> Union[WsCreate, DeferredError, None]:
        """What the lane does next (None: nothing, or the connection is closed). A create is the
        lane's current one until `turn_ended`."""
        lane = self.lanes.get(key)
        if lane is None or not lane.pending or self.state is State.CLOSED:
            return None
        item = lane.pending.popleft()
        self.queued_bytes -= item.nbytes
        if isinstance(item, DeferredError):
            self.deferred_errors -= 1
        else:
            self.waiting_creates -= 1
            self.replica_queue.give(item.nbytes)
            lane.current = item
        return item

    def turn_ended(self, key: str, now: float) -> None:
        lane = self.lanes.get(key)
        if lane is not None:
            lane.current = None
        self.last_activity = now

    def lane_stopped(self, key: str) -> list[Action]:
        """The lane's runner ran out of work: forget the lane, and end the connection if it was
        waiting for the responses in flight."""
        lane = self.lanes.get(key)
        if lane is not None and lane.busy:
            return [RunLane(key)]  # work arrived as it stopped
        self.lanes.pop(key, None)
        if self.state is State.ENDING and not self.busy:
            return self._close(self.end)
        return []

    @property
    def busy(self) -> bool:
        """A response is running or waiting on some lane (or an error waits for its turn)."""
        return any(lane.busy for lane in self.lanes.values())

    def queued(self) -> list[WsCreate]:
        return [c for lane in self.lanes.values() for c in lane.pending if isinstance(c, WsCreate)]

    def starting(self) -> list[WsCreate]:
        return [lane.current for lane in self.lanes.values() if lane.current is not None]

    def _lane(self, key: str) -> Lane:
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane()
        return lane

    # -- a create's turn: the session runs it, these decide around it ---------------------
    def held_bytes(self) -> int:
        """Steering input and injected tool outputs this connection holds (ReplicaHeld sums them)."""
        return self.inflight.held_bytes()

    def fork_source(self, create: WsCreate) -> Optional[WsCreate]:
        """The create on another lane, queued or running, whose response this one continues: its
        lane waits for that create to be done before starting it."""
        return self.inflight.fork_source(create, self.queued())

    def begin_turn(self, create: WsCreate, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The body the create's turn runs (steering input queued for its parent goes first, and
        is committed by this response), and whether its parent came from another lane (a failed
        fork must leave that parent cached: its own lane may continue it)."""
        if not create.commits:
            create.commits = self.inflight.queued_steers_for(body)
            if create.commits:
                body = steering.with_queued_input(body, create.commits)
        return body, self.inflight.from_other_lane(body.get("previous_response_id"), create.stream_id)

    def turn_admitted(self, create: WsCreate, request: ResponsesRequest, body: dict[str, Any]) -> None:
        """Its request is admitted: whether steers may stop it; a multi-agent response's inbox."""
        create.steerable = not (request.is_warm_up or body.get("conversation") or body.get("context_management"))
        if multi_agent_enabled(body):
            create.inbox = AgentInbox(self.config.agent_wait_seconds)

    def turn_event(self, create: WsCreate, event: Event) -> None:
        """An event its turn sends: what interrupts, steers and injects act on (its id, its calls)."""
        step = create.progress.observe(event)
        if step is Milestone.CREATED:
            self.inflight.started(create, create.progress.response_id)
        elif step is Milestone.ITEM_ADDED:
            self.inflight.emitted(create, create.progress.last_item)
        elif step is Milestone.TERMINAL:
            self.finished.append(create.progress.response_id)
            final = create.progress.final
            self.stored = self.stored or (final.get("store") is not False and final["status"] != "failed")

    def turn_finished(self, create: WsCreate, error: Optional[ApiError] = None) -> tuple[Optional[WsCreate], list[Action]]:
        """The create's turn is over (`error`: it failed before or instead of its events): what
        to send, and the successor its steers ask for, which runs next in the same slot."""
        progress = create.progress
        self.inflight.ended(progress.response_id)
        actions: list[Action] = []
        if error is not None and progress.response_id is None and create.commits:
            # The steering input it was to commit never was: each steer comes back failed.
            actions += [SendEvent(steering.failed_steer(
                steer, "successor_creation_failed", f"The successor response could not be created: {error.message}",
                create.stream_id)) for steer in create.commits]
        elif error is not None:
            actions.append(SendError(error, create.stream_id))
        if not create.steers:
            return None, actions
        successor, events = self.inflight.after_steered(create, progress.final)
        return successor, actions + [SendEvent(ev) for ev in events]

    # -- the connection's life ----------------------------------------------------------
    def tick(self, now: float) -> tuple[list[Action], Optional[float]]:
        """The lifetime limit and the idle timeout: actions now, and seconds until the next
        tick is due (None: no more ticks)."""
        if self.state is not State.OPEN:
            return [], None
        cfg = self.config
        life_left = cfg.max_connection_seconds - (now - self.started_at)
        idle_left = cfg.idle_timeout_seconds - (now - self.last_activity)
        if life_left <= 0:
            return self._ending(End.LIFETIME), None
        if idle_left <= 0 and not self.busy:
            return self._close(End.IDLE), None
        return [], max(0.05, min(life_left, idle_left if idle_left > 0 else 0.5))

    def drain(self) -> list[Action]:
        """The server is going away: finish the responses in flight, then tell the client to
        reconnect (the connection-limit error it already handles) and close with 1001."""
        if self.state is State.CLOSED:
            return []
        return self._ending(End.DRAIN)

    def client_left(self) -> None:
        """The socket is gone: nothing more is sent, what waited is dropped."""
        self.state = State.CLOSED
        self.replica_queue.give(sum(c.nbytes for c in self.queued()))
        self.lanes.clear()
        self.queued_bytes = self.waiting_creates = self.deferred_errors = 0

    def _ending(self, why: End) -> list[Action]:
        self.state = State.ENDING
        self.end = why
        return [] if self.busy else self._close(why)

    def _close(self, why: Optional[End]) -> list[Action]:
        if self.state is State.CLOSED:
            return []
        self.state = State.CLOSED
        self.end = why
        return closing(why, self.config)
