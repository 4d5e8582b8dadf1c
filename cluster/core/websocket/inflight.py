"""The responses in flight on one WebSocket connection, and the client events that act on a
response while it runs (docs/protocol.md): `response.interrupt`, `response.steer`,
`response.inject`, and forks across `stream_id` lanes.

Plain logic: each handler takes the event and returns the events to send (or an error for the
connection's FIFO); the session (session.py) owns the tasks, lanes and the socket.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from cluster.core.events import Event, build_response
from cluster.core.messages import TurnProgress
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.turn import Stop
from cluster.core.websocket import agent, steering
from cluster.core.websocket.agent import AgentInbox
from cluster.core.websocket.steering import Steer
from cluster.protocol.errors import ApiError
from cluster.protocol.ids import new_id
from cluster.protocol.request_bounds import load_event
from cluster.protocol.requests import parse_request

MAX_REMEMBERED_LANES = 1024  # which lane made each recent response (cross-lane forks)


def create_body(event: dict[str, Any]) -> dict[str, Any]:
    """A `response.create` event's request body (the nested form some clients send,
    `{"type", "response": {...}}`, tolerated)."""
    body = {k: v for k, v in event.items() if k != "type"}
    if isinstance(body.get("response"), dict) and "input" not in body:
        body = {**body.pop("response"), **body}
    return body


@dataclass
class WsCreate:
    """One `response.create` on a connection, from its frame to its response's end."""

    body: dict[str, Any]
    received_at: Optional[float]
    stream_id: Optional[str]
    nbytes: int = 0  # what `body` holds parsed: counted against `max_queued_bytes` until the create starts
    response_id: Optional[str] = None  # given when `response.queued` announced it, else at `response.created`
    admitted: bool = False  # counted against the key's rate limit on arrival (a large frame)
    announced: asyncio.Event = field(default_factory=asyncio.Event)  # its `response.queued` (if any) is out
    stop: Stop = field(default_factory=Stop)  # `response.interrupt` or `response.steer` named it
    commits: list[Steer] = field(default_factory=list)  # steering input its `response.created` commits
    steers: list[Steer] = field(default_factory=list)  # accepted steers for its response while it runs
    calls: int = 0  # client-owned tool calls its response emitted
    done: asyncio.Event = field(default_factory=asyncio.Event)  # it ran (a fork on another lane waits for it)
    steerable: bool = False
    inbox: Optional[AgentInbox] = None  # a multi-agent response: its injected tool outputs
    # A large create that waits is held as the frame it came in (one string), its body without its
    # input: parsed, 10,000 small items are ~4 MB in ~30,000 objects, and every full collection of
    # Python's GC walks each of them while it waits (a replica's queue of them stalled every
    # socket's turn for seconds). Parsed again when its lane starts it.
    frame: Optional[Any] = None
    large: bool = False  # its frame was over ADMIT_BEFORE_PARSE_BYTES: it starts through its tenant's gate
    size: int = 0  # its frame's bytes: what it counts against its key's input bytes
    progress: TurnProgress = field(default_factory=TurnProgress)  # what its turn has sent so far

    @property
    def lane(self) -> str:
        return self.stream_id or ""

    def start_body(self) -> dict[str, Any]:
        """The whole body, as the lane starts the create: a held frame is parsed here (its input
        for the first time, when only its other fields were read on arrival), or an ApiError."""
        if self.frame is not None:
            frame, self.frame = self.frame, None
            self.body = create_body(load_event(frame, counted=True)[0])  # counted on arrival
        return self.body


@dataclass
class Lane:
    pending: deque = field(default_factory=deque)  # WsCreate | actions.DeferredError
    current: Optional[WsCreate] = None  # taken from `pending`, until its turn ends

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.pending)

    @property
    def has_creates(self) -> bool:
        return self.current is not None or any(isinstance(item, WsCreate) for item in self.pending)


def queued_event(create: WsCreate, model_name: str, sampling: dict[str, float],
                 max_input_items: Optional[int]) -> Optional[Event]:
    """`response.queued` for a create that has to wait (None: its error is sent in lane order)."""
    try:
        # The announcement needs the request's settings, not its input: validating 10,000 items
        # here would be paid again when the lane starts it (its input's errors come then).
        req = parse_request({**create.body, "input": None}, max_input_items=max_input_items)
    except ApiError:
        return None
    # Only the id is kept: the parsed request would hold the body twice while it waits (the
    # lane parses it again when it starts it).
    create.response_id = new_id("resp")
    response = build_response(response_id=create.response_id, model=model_name, request=req,
                              previous_response_id=req.previous_response_id, sampling=sampling)
    response["status"] = "queued"
    event: Event = {"type": "response.queued", "sequence_number": 0, "response": response}
    if create.stream_id:
        event["stream_id"] = create.stream_id
    return event


class ReplicaHeld:
    """Steering input and injected tool outputs held on every socket of one replica, against one
    bound. Their lifetimes end in many places (committed, failed, taken in, the socket gone), so
    the total is summed over the replica's sockets (`sample`) at most every `refresh_s`; what is
    taken in between is added at once, so the bound holds between samples too."""

    def __init__(self, limit: int, sample: Optional[Callable[[], int]] = None, refresh_s: float = 0.1,
                 clock: Optional[Callable[[], float]] = None) -> None:
        self.limit, self.sample, self.refresh_s = limit, sample, refresh_s
        self.clock = clock or time.monotonic
        self.held = 0
        self._at = float("-inf")

    def room(self) -> int:
        now = self.clock()
        if self.sample is not None and now - self._at >= self.refresh_s:
            self.held, self._at = self.sample(), now
        return max(0, self.limit - self.held)

    def take(self, nbytes: int) -> bool:
        if nbytes > self.room():
            return False
        self.held += nbytes
        return True


class InFlight:
    def __init__(self, replica_held: Optional[ReplicaHeld] = None) -> None:
        # Every socket's steering and injected bytes of this replica (none: this socket's bounds only).
        self.replica_held = replica_held if replica_held is not None else ReplicaHeld(1 << 62)
        self.active: dict[str, WsCreate] = {}  # running response id -> its create
        self._lane_of: OrderedDict[str, str] = OrderedDict()  # recent response id -> the lane that made it
        # Responses that stopped for tool output with accepted steers: id -> (steers, lane, stubs).
        self._pending_steers: dict[str, tuple[list[Steer], Optional[str], list[dict[str, Any]]]] = {}

    # -- a response's life ---------------------------------------------------------
    def started(self, create: WsCreate, response_id: str) -> None:
        create.response_id = response_id
        self.active[response_id] = create
        self._lane_of[response_id] = create.lane
        if len(self._lane_of) > MAX_REMEMBERED_LANES:
            self._lane_of.popitem(last=False)

    def emitted(self, create: WsCreate, item: dict[str, Any]) -> None:
        """An output item the response started (client tool calls are owed an output)."""
        if item["type"] in ("function_call", "custom_tool_call"):
            create.calls += 1
            if create.inbox is not None:
                create.inbox.called(item["call_id"], item.get("name", ""))

    def ended(self, response_id: Optional[str]) -> None:
        if response_id is not None:
            self.active.pop(response_id, None)

    def queued_steers_for(self, body: dict[str, Any]) -> list[Steer]:
        """An explicit continuation of a response that stopped for tool output: the steering
        input queued for it (taken: it goes first in this request's input)."""
        parent = body.get("previous_response_id")
        if isinstance(parent, str) and parent in self._pending_steers:
            return self._pending_steers.pop(parent)[0]
        return []

    # -- forks across lanes --------------------------------------------------------
    def fork_source(self, create: WsCreate, queued: Iterable[WsCreate]) -> Optional[WsCreate]:
        """The create on another lane, queued or running, whose response this create continues."""
        parent = create.body.get("previous_response_id")
        if not isinstance(parent, str):
            return None
        source = self.active.get(parent) or next((c for c in queued if c.response_id == parent), None)
        if source is None or source is create or source.lane == create.lane:
            return None
        return source

    def from_other_lane(self, parent: Any, stream_id: Optional[str]) -> bool:
        lane = self._lane_of.get(parent) if isinstance(parent, str) else None
        return lane is not None and lane != (stream_id or "")

    # -- events acting on a response in flight -------------------------------------
    def interrupt(self, event: dict[str, Any], waiting: Iterable[WsCreate] = ()) -> Optional[ApiError]:
        """Codex's `response.interrupt`. The interrupted response's `response.incomplete` (reason
        `interrupted`) is the acknowledgement; an interrupt for a response that already ended is
        ignored (an error event here would be read as the next turn's first event)."""
        response_id, mode = event.get("response_id"), event.get("mode", "discard_partial_items")
        if not isinstance(response_id, str) or not response_id:
            return ApiError(400, "response.interrupt needs a 'response_id'.", param="response_id",
                            code="missing_required_parameter")
        if mode != "discard_partial_items":
            return ApiError(400, f"Unsupported interrupt mode '{mode}'; supported: 'discard_partial_items'.",
                            param="mode", code="invalid_value")
        create = self.active.get(response_id)
        if create is None:  # announced with `response.queued`: it ends interrupted when its turn comes
            create = next((c for c in waiting if c.response_id == response_id), None)
        if create is not None:
            create.stop.set("interrupted")
        return None

    def steer(self, event: dict[str, Any], cache: SessionCache, queued: Iterable[WsCreate]) -> list[Event]:
        """`response.steer`: accepted, failed, or (its response already waits for tool output)
        accepted and pending; applied when the response stops (see steering.py)."""
        try:
            steer = steering.parse_steer(event)
        except steering.SteerRejected as rej:
            return [steering.failed(rej.code, rej.message, input=event.get("input"),
                                    previous_response_id=event.get("previous_response_id"))]
        target = steer.previous_response_id
        create, waiting = self.active.get(target), self._pending_steers.get(target)
        if create is not None or waiting is not None:
            steers, stream_id = (create.steers, create.stream_id) if create is not None else waiting[:2]
            if create is not None and not create.steerable:
                refusal = ("steering_not_supported", "This response cannot be steered (a warm-up, or bound to a "
                                                     "conversation or automatic compaction).")
            elif len(steers) >= steering.MAX_STEERS_PER_RESPONSE:
                refusal = ("too_many_pending_steers",
                           f"This response already has {steering.MAX_STEERS_PER_RESPONSE} steering inputs queued.")
            elif self.steer_bytes() + steer.nbytes > steering.MAX_STEER_BYTES:
                refusal = ("too_many_pending_steers", f"Steering inputs on this connection would hold more than "
                                                      f"{steering.MAX_STEER_BYTES} bytes; wait for them to apply.")
            elif not self.replica_held.take(steer.nbytes):
                refusal = ("too_many_pending_steers", "This server holds too much steering input and injected "
                                                      "output across its connections; retry shortly.")
            else:
                steers.append(steer)
                if create is None:  # it already stopped for tool output
                    return [steering.accepted(steer, stream_id), steering.pending(steer, waiting[2], stream_id)]
                if not create.calls:  # stop at once: no tool call is owed
                    create.stop.set("steered")
                return [steering.accepted(steer, stream_id)]
            return [steering.failed_steer(steer, *refusal, stream_id)]
        if target in cache:
            refusal = ("response_already_completed", "That response has finished; send a response.create instead.")
        elif any(c.response_id == target for c in queued):
            refusal = ("response_not_active", "That response has not started yet.")
        else:
            refusal = ("response_not_found", f"No response with id '{target}' is active on this connection.")
        return [steering.failed(*refusal, previous_response_id=target, input=steer.input)]

    def injected_bytes(self) -> int:
        return sum(c.inbox.nbytes for c in self.active.values() if c.inbox is not None)

    def held_bytes(self) -> int:
        """Steering input and injected outputs this connection holds (the replica sums them)."""
        return self.steer_bytes() + self.injected_bytes()

    def steer_bytes(self) -> int:
        """Bytes of steering input held on this connection: running responses' and pending parents'."""
        held = [s for c in self.active.values() for s in c.steers]
        held += [s for steers, _, _ in self._pending_steers.values() for s in steers]
        return sum(s.nbytes for s in held)

    def after_steered(self, create: WsCreate, final: Optional[dict[str, Any]]) -> tuple[Optional[WsCreate], list[Event]]:
        """What a response that had steers queued leads to: its successor (the next create on its
        lane), `response.steer.pending` events, or the steers returned as failed."""
        steers, stream_id = create.steers, create.stream_id
        status = final["status"] if final is not None else "cancelled"
        reason = ((final or {}).get("incomplete_details") or {}).get("reason")
        required = steering.required_input(final["output"]) if status == "completed" else []
        if required:
            if len(self._pending_steers) >= steering.MAX_PENDING_PARENTS:
                return None, [steering.failed_steer(s, "too_many_pending_steers", "Too many responses on this "
                                                    "connection wait for tool output with steering input.", stream_id)
                              for s in steers]
            self._pending_steers[final["id"]] = (steers, stream_id, required)
            return None, [steering.pending(s, required, stream_id) for s in steers]
        if status == "completed" or reason == "steered":
            body = steering.successor_body(create.body, final["id"], steers)
            return WsCreate(body, time.perf_counter(), stream_id, commits=steers), []
        return None, [steering.failed_steer(s, "response_not_active", f"The response ended {status} before the "
                                            "steering input could be committed.", stream_id) for s in steers]

    def inject(self, event: dict[str, Any], cache: SessionCache) -> list[Event]:
        """`response.inject` (beta): tool outputs for a multi-agent response in flight, committed
        all or none. ApiError (raised) when the event itself is malformed."""
        response_id, items = event.get("response_id"), event.get("input")
        if not isinstance(response_id, str) or not response_id:
            raise ApiError(400, "response.inject needs a 'response_id'.", param="response_id",
                           code="missing_required_parameter")
        create = self.active.get(response_id)
        if create is None:
            code, message = (("response_already_completed", "That response has finished; send the outputs with "
                                                            "response.create.") if response_id in cache
                             else ("response_not_found", f"No response with id '{response_id}' is active on this "
                                                         "connection."))
            return [agent.inject_failed(response_id, items, code, message, None)]
        try:
            if create.inbox is None:
                raise ApiError(400, "response.inject applies to responses created with multi_agent.enabled.",
                               param="response_id", code="invalid_value")
            held = self.injected_bytes()
            before = create.inbox.nbytes
            create.inbox.offer(items, room=min(agent.MAX_INJECTED_BYTES - held, self.replica_held.room()))
            self.replica_held.take(create.inbox.nbytes - before)
        except ApiError as err:
            ev = err.ws_event()
            if create.stream_id:
                ev["stream_id"] = create.stream_id
            return [ev]
        return [agent.inject_created(response_id, create.stream_id)]
