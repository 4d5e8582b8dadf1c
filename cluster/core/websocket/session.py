"""WebSocket mode (PROTOCOL §5) as transport-free logic: frames in, events out.

The ASGI route feeds received frames to `on_frame` and gives `send`/`close`
callables; everything else (frames handled in arrival order, `stream_id` lanes,
warm-up, errors that keep the socket open, connection time limit, cancellation
on disconnect) lives here.

Lanes: a `response.create` runs on the lane its `stream_id` names (no stream_id:
the connection's default lane). Each lane is FIFO; lanes run concurrently, at
most `MAX_ACTIVE` responses at once (more wait); at most `MAX_LANES` named lanes
exist at a time. A create that has to wait is told so with `response.queued`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Union

from cluster.config import WebSocketConfig
from cluster.core.events import build_response
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.driver import Lookup, TurnDriver
from cluster.core.websocket import agent, steering
from cluster.core.websocket.agent import AgentInbox
from cluster.core.websocket.inflight import InFlight, WsCreate
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.ids import new_id
from cluster.protocol.requests import json_depth_error, parse_request

log = logging.getLogger(__name__)

IGNORED_TYPES = frozenset({"response.processed", "response.append"})
MAX_ACTIVE = 16  # responses running at once on one connection
MAX_LANES = 32  # named lanes (stream_id) at once on one connection
_STREAM_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,256}$")


@dataclass
class _Lane:
    pending: deque = field(default_factory=deque)
    running: bool = False
    task: Optional[asyncio.Task] = None
    current: Optional[WsCreate] = None  # taken from `pending`, until its turn ends

    @property
    def busy(self) -> bool:
        return self.running or bool(self.pending)

    @property
    def has_creates(self) -> bool:
        return self.running or any(isinstance(item, WsCreate) for item in self.pending)
Event = dict[str, Any]
Send = Callable[[Event], Awaitable[None]]
Close = Callable[[int, str], Awaitable[None]]


def frame_bytes(data: Union[str, bytes]) -> int:
    """A frame's size in bytes as it came over the wire (UTF-8 for text frames)."""
    if isinstance(data, bytes):
        return len(data)
    return len(data) if data.isascii() else len(data.encode())


def _error_nbytes(err: ApiError) -> int:
    return 256 + len(err.message) + len(err.param or "")


def frame_too_large(size: int, limit: int) -> ApiError:
    # Codex knows this code (`websocket_message_too_large`); the frame is dropped, the socket stays.
    return ApiError(400, f"The message is {size} bytes; the limit is {limit} bytes.",
                    code="websocket_message_too_large")


class WebSocketSession:
    def __init__(
        self,
        driver: TurnDriver,
        cache: SessionCache,
        *,
        session_key: str,
        config: WebSocketConfig,
        send: Send,
        close: Close,
        lookup: Optional[Lookup] = None,
        on_state: Optional[Callable[[Any], None]] = None,
        owner: Optional[str] = None,
        admit: Optional[Callable[[], None]] = None,
        trace_parent: Any = None,
        timing_metrics: bool = False,
        betas: frozenset[str] = frozenset(),
    ) -> None:
        self.driver = driver
        self.cache = cache
        self.session_key = session_key
        self.config = config
        self._send = send
        self._close = close
        self._lookup = lookup
        self._on_state = on_state  # e.g. publish `store: true` responses replica-wide
        self._owner = owner
        self._admit = admit  # per-key rate limit for each response.create (raises ApiError)
        self._trace_parent = trace_parent  # a `traceparent` sent on the upgrade: every turn joins that trace
        # `x-responsesapi-include-timing-metrics` on the upgrade: each turn sends Codex's timing event.
        self._timing_metrics = timing_metrics
        self._betas = betas  # `OpenAI-Beta` values on the upgrade (multi-agent responses need theirs)
        # Frames waiting for the connection's FIFO: (frame, or the error it earned; arrival time).
        self._queue: asyncio.Queue[tuple[Union[str, bytes, ApiError], float]] = asyncio.Queue()
        self._queued_bytes = 0  # frames waiting to be read, and creates waiting on their lanes
        self._waiting_creates = 0  # creates waiting on their lanes (not yet started)
        self._deferred_errors = 0  # frame errors waiting for their turn in the FIFO (not yet sent)
        self._worker: Optional[asyncio.Task] = None
        self._timer: Optional[asyncio.Task] = None
        self._lanes: dict[str, _Lane] = {}  # "" = the default lane
        self._inflight = InFlight()  # running responses; interrupt, steer, inject, forks (inflight.py)
        self._slots = asyncio.Semaphore(MAX_ACTIVE)
        self.expired = False
        self.draining = False
        self.idle = False
        self.closed = False
        self._last_activity = time.monotonic()
        self.responses = 0

    def start(self) -> None:
        self._worker = asyncio.create_task(self._work(), name=f"ws-worker-{self.session_key}")
        self._timer = asyncio.create_task(self._limit(), name=f"ws-limit-{self.session_key}")

    async def on_frame(self, data: Union[str, bytes]) -> None:
        if self.closed:
            return
        cfg = self.config
        if self._deferred_errors >= cfg.max_queued_creates:
            # Invalid frames faster than their errors are read: nothing more is held for this client.
            await self._flooded()
            return
        if self._queue.qsize() + self._waiting_creates + self._deferred_errors >= cfg.max_queued_creates:
            await self._send_error(
                ApiError(429, "Too many queued requests on this connection.", code="rate_limit_exceeded")
            )
            return
        self._last_activity = time.monotonic()
        size = frame_bytes(data)
        if size > cfg.max_frame_bytes:
            # Checked before queueing: an oversized frame is never held. Its error
            # keeps its place in the FIFO (after the responses queued before it).
            self._queue.put_nowait((frame_too_large(size, cfg.max_frame_bytes), time.perf_counter()))
            return
        if self._queued_bytes + len(data) > cfg.max_queued_bytes:
            await self._send_error(ApiError(
                429, f"Too many bytes queued on this connection (limit {cfg.max_queued_bytes}); wait for the "
                     "responses in flight.", code="rate_limit_exceeded"))
            return
        self._queued_bytes += len(data)
        self._queue.put_nowait((data, time.perf_counter()))

    @property
    def busy(self) -> bool:
        """A response is running or waiting on some lane."""
        return any(lane.busy for lane in self._lanes.values())

    async def shutdown(self) -> None:
        """The client went away: cancel the in-flight turns, drop the queues."""
        self.closed = True
        tasks = [self._timer, self._worker, *(lane.task for lane in self._lanes.values())]
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
        for task in tasks:  # each turn's cleanup (engine abort, post-work) runs before this returns
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_bytes = self._waiting_creates = self._deferred_errors = 0
        self.cache.clear()  # `store: false` states die with their socket; the replica bound gets them back

    async def drain(self) -> None:
        """The server is going away (scale-down): finish the turn in flight, then
        tell the client to reconnect (the connection-limit error it already
        handles) and close with 1001."""
        self.draining = self.expired = True
        if not self.busy and self._queue.empty():
            await self._expire()

    async def wait_idle(self) -> None:
        """For tests: until every queued frame has been handled and every lane is idle."""
        await self._queue.join()
        await self._wait_lanes()

    # -- internals -------------------------------------------------------------
    async def _limit(self) -> None:
        """The connection's lifetime limit and its idle timeout."""
        started = time.monotonic()
        cfg = self.config
        while True:
            now = time.monotonic()
            life_left = cfg.max_connection_seconds - (now - started)
            idle_left = cfg.idle_timeout_seconds - (now - self._last_activity)
            if life_left <= 0:
                self.expired = True
                if not self.busy and self._queue.empty():
                    await self._expire()
                return  # else: the worker closes after the response in flight
            if idle_left <= 0 and not self.busy and self._queue.empty():
                self.idle = True
                await self._expire()
                return
            await asyncio.sleep(max(0.05, min(life_left, idle_left if idle_left > 0 else 0.5)))

    async def _expire(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.draining:
            message = ("This server is shutting down this connection (scale-down or restart). "
                       "Create a new websocket connection to continue.")
        elif self.idle:
            message = (f"This websocket connection was closed after {self.config.idle_timeout_seconds:.0f} "
                       "seconds without activity. Create a new websocket connection to continue.")
        else:
            message = ("Responses websocket connection limit reached (60 minutes). "
                       "Create a new websocket connection to continue.")
        await self._send_error(ApiError(400, message, code="websocket_connection_limit_reached"))
        if self.draining:
            await self._close(1001, "server draining: reconnect")
        else:
            await self._close(1000, "connection limit reached")

    async def _work(self) -> None:
        """Frames in arrival order: errors answered here, creates handed to their lane."""
        while True:
            data, received_at = await self._queue.get()
            if not isinstance(data, ApiError):
                self._queued_bytes -= len(data)  # a create counts again while it waits on its lane
            try:
                if self.expired:
                    await self._wait_lanes()
                    await self._expire()
                    return
                await self._handle(data, received_at)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one frame kill the connection
                log.exception("websocket frame handling failed")
                await self._send_error(server_error())
            finally:
                self._last_activity = time.monotonic()
                self._queue.task_done()
            if self.expired and self._queue.empty():
                await self._wait_lanes()
                await self._expire()
                return

    async def _wait_lanes(self) -> None:
        while self.busy:
            tasks = [lane.task for lane in self._lanes.values() if lane.task is not None and not lane.task.done()]
            if not tasks:
                return  # closed: what is left on the lanes will not run
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _enqueue(self, body: dict[str, Any], received_at: Optional[float], nbytes: int = 0) -> None:
        """Put a create on its lane; announce `response.queued` when it has to wait."""
        stream_id = body.get("stream_id")
        if stream_id is not None and not (isinstance(stream_id, str) and _STREAM_ID.match(stream_id)):
            self._defer_error(ApiError(400, "stream_id must be 1-256 characters of [A-Za-z0-9_.-].",
                                       param="stream_id", code="invalid_stream_id"))
            return
        key = stream_id or ""
        lane = self._lanes.get(key)
        if lane is None:
            if key and sum(1 for k in self._lanes if k) >= MAX_LANES:
                self._defer_error(ApiError(
                    400, f"This connection already has {MAX_LANES} active stream_id lanes; wait for one to finish.",
                    param="stream_id", code="websocket_stream_limit_reached"), stream_id=stream_id)
                return
            lane = self._lane(key)
        create = WsCreate(body, received_at, stream_id, nbytes=nbytes)
        self._queued_bytes += nbytes
        self._waiting_creates += 1
        # Each busy lane holds (or waits for) one of the MAX_ACTIVE slots.
        waits = lane.has_creates or sum(1 for other in self._lanes.values() if other.has_creates) >= MAX_ACTIVE
        # On the lane before any await (its task may be ending); it starts only once announced.
        lane.pending.append(create)
        self._start_lane(key)
        if waits:
            await self._announce_queued(create)
        create.announced.set()

    def _defer_error(self, err: ApiError, stream_id: Optional[str] = None) -> None:
        """A frame's error goes out in FIFO order on the default lane, after the responses before
        it (a client without lanes must not read it as the failure of the response in flight)."""
        self._deferred_errors += 1
        self._queued_bytes += _error_nbytes(err)  # its message may quote what the client sent
        self._lane("").pending.append((err, stream_id))
        self._start_lane("")

    async def _flooded(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self._send_error(ApiError(400, f"More than {self.config.max_queued_creates} invalid messages are "
                                             "waiting for their errors to be read; closing this connection.",
                                        code="too_many_errors"))
        await self._close(1008, "too many errors not read")

    def _lane(self, key: str) -> _Lane:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        return lane

    def _start_lane(self, key: str) -> None:
        lane = self._lanes[key]
        if lane.task is None or lane.task.done():
            lane.task = asyncio.create_task(self._run_lane(key, lane), name=f"ws-lane-{self.session_key}-{key}")

    async def _announce_queued(self, create: WsCreate) -> None:
        try:
            req = parse_request(create.body, max_input_items=self.driver.settings.max_input_items)
        except ApiError:
            return  # its error is sent when its turn comes, in lane order
        create.response_id = new_id("resp")
        response = build_response(response_id=create.response_id, model=self.driver.model_name, request=req,
                                  previous_response_id=req.previous_response_id)
        response["status"] = "queued"
        event: dict[str, Any] = {"type": "response.queued", "sequence_number": 0, "response": response}
        if create.stream_id:
            event["stream_id"] = create.stream_id
        await self._send(event)

    async def _run_lane(self, key: str, lane: _Lane) -> None:
        try:
            while lane.pending and not self.closed:
                create = lane.pending.popleft()
                if not isinstance(create, WsCreate):  # a deferred frame error
                    self._deferred_errors -= 1
                    self._queued_bytes -= _error_nbytes(create[0])
                    await self._send_error(*create)
                    continue
                self._queued_bytes -= create.nbytes
                self._waiting_creates -= 1
                lane.running = True
                lane.current = create
                try:
                    await create.announced.wait()
                    source = self._inflight.fork_source(create, self._queued())
                    if source is not None:  # it continues a response another lane has not finished yet
                        await source.done.wait()
                    async with self._slots:
                        while create is not None:  # a steered response's successor runs next, in its slot
                            create = await self._turn(create)
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let one response kill the connection
                    log.exception("websocket response failed")
                    await self._send_error(server_error(), stream_id=create.stream_id)
                finally:
                    lane.running = False
                    lane.current = None
                    self._last_activity = time.monotonic()
        finally:
            if not lane.busy and self._lanes.get(key) is lane:
                del self._lanes[key]
        if self.expired and not self.busy and self._queue.empty():
            await self._expire()  # the connection limit or a drain waited for the responses in flight

    async def _handle(self, data: Union[str, bytes, ApiError], received_at: Optional[float] = None) -> None:
        """One frame: a create goes to its lane, anything else is answered in FIFO order."""
        if isinstance(data, ApiError):
            self._defer_error(data)
            return
        try:
            event = json.loads(data)
        except (ValueError, RecursionError) as exc:
            reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            self._defer_error(ApiError(400, f"The message is not valid JSON: {reason}.", code="invalid_json"))
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self._defer_error(
                ApiError(400, "Each message must be a JSON object with a 'type'.", param="type", code="missing_required_parameter")
            )
            return
        too_deep = json_depth_error(event)  # steers and injects too, before anything holds them
        if too_deep is not None:
            self._defer_error(too_deep)
            return
        kind = event["type"]
        if kind in IGNORED_TYPES:
            return
        # Events acting on a response in flight: answered at once, never queued behind it.
        if kind == "response.interrupt":
            # A response announced as queued (or starting) stops too, as soon as it starts.
            err = self._inflight.interrupt(event, [*self._queued(), *self._starting()])
            if err is not None:
                self._defer_error(err)
            return
        if kind in ("response.steer", "response.inject"):
            try:
                events = (self._inflight.steer(event, self.cache, self._queued()) if kind == "response.steer"
                          else self._inflight.inject(event, self.cache))
            except ApiError as err:
                self._defer_error(err)
                return
            for ev in events:
                await self._send_quietly(ev)
            return
        if kind != "response.create":
            self._defer_error(
                ApiError(400, f"Invalid event type '{kind}'. Supported: 'response.create', 'response.steer', "
                          "'response.interrupt', 'response.inject'.", param="type", code="invalid_value")
            )
            return
        body = {k: v for k, v in event.items() if k != "type"}
        if isinstance(body.get("response"), dict) and "input" not in body:
            # Tolerate the nested form some clients send: {"type", "response": {...}}.
            body = {**body.pop("response"), **body}
        await self._enqueue(body, received_at, len(data))

    def _queued(self) -> list[WsCreate]:
        return [c for lane in self._lanes.values() for c in lane.pending if isinstance(c, WsCreate)]

    def _starting(self) -> list[WsCreate]:
        return [lane.current for lane in self._lanes.values() if lane.current is not None]

    async def _turn(self, create: WsCreate) -> Optional[WsCreate]:
        """Run one create; returns the successor a steer asked for (or None)."""
        try:
            return await self._run_create(create)
        finally:
            create.done.set()

    async def _run_create(self, create: WsCreate) -> Optional[WsCreate]:
        body, received_at = create.body, create.received_at
        parent = body.get("previous_response_id")
        if not create.commits:
            create.commits = self._inflight.queued_steers_for(body)
            if create.commits:  # steering input queued for the parent goes first
                body = steering.with_queued_input(body, create.commits)
        rid: Optional[str] = None
        final: Optional[dict[str, Any]] = None
        try:
            if self._admit is not None:
                self._admit()
            req = parse_request(body, max_input_items=self.driver.settings.max_input_items)
            create.steerable = not (req.is_warm_up or body.get("conversation") or body.get("context_management"))
            if agent.multi_agent_enabled(body):
                if agent.BETA not in self._betas:
                    raise ApiError(400, f"multi_agent needs the 'OpenAI-Beta: {agent.BETA}' header on the WebSocket "
                                        "upgrade.", param="multi_agent", code="invalid_value")
                create.inbox = AgentInbox(self.config.agent_wait_seconds)
            parsed_at = time.perf_counter()
            if req.background:
                raise ApiError(400, "background is not supported in websocket mode.", param="background", code="invalid_value")
            stream_id = req.stream_id
            async for ev in self.driver.run(
                req,
                self.cache,
                session_key=self.session_key,
                lookup=self._lookup if req.store is not False else None,
                on_state=self._on_state,
                stream_id=stream_id,
                owner=self._owner,
                received_at=received_at,
                parsed_at=parsed_at,
                trace_parent=self._trace_parent,
                transport="websocket",
                include_timing=self._timing_metrics,
                response_id=create.response_id,
                stop=create.stop,
                # A fork from another lane that fails leaves that lane's response in the cache.
                keep_parent=self._inflight.from_other_lane(parent, stream_id),
                agent=create.inbox,
            ):
                kind = ev["type"]
                if kind == "response.created":
                    rid = ev["response"]["id"]
                    self._inflight.started(create, rid)
                elif kind == "response.output_item.added":
                    self._inflight.emitted(create, ev["item"])
                elif kind in ("response.completed", "response.incomplete", "response.failed"):
                    final = ev["response"]
                await self._send(ev)
            self.responses += 1
        except ApiError as err:
            stream_id = body.get("stream_id") if isinstance(body.get("stream_id"), str) else None
            if rid is None and create.commits:  # the steering input was never committed: return it
                for steer in create.commits:
                    await self._send_quietly(steering.failed_steer(
                        steer, "successor_creation_failed", f"The successor response could not be created: "
                                                            f"{err.message}", stream_id))
            else:
                await self._send_error(err, stream_id=stream_id)
        finally:
            self._inflight.ended(rid)
        if not create.steers:
            return None
        successor, events = self._inflight.after_steered(create, final)
        for ev in events:
            await self._send_quietly(ev)
        return successor

    async def _send_quietly(self, ev: Event) -> None:
        try:
            await self._send(ev)
        except Exception:  # the socket may be gone already
            pass

    async def _send_error(self, err: ApiError, stream_id: Optional[str] = None) -> None:
        ev = err.ws_event()
        if stream_id:
            ev["stream_id"] = stream_id
        await self._send_quietly(ev)
