"""WebSocket mode over asyncio: pumps frames, lane tasks and the connection's timer through
the sans-I/O `WebSocketProtocol` (protocol.py), and runs each create through the turn driver.

The ASGI route feeds received frames to `on_frame` and gives `send`/`close` callables. What a
frame means, which lane runs what, what is bounded and when the connection ends are the
protocol's to decide; this class performs its actions: it owns the tasks (one per busy lane,
one timer), the `MAX_ACTIVE` slots and the socket's send and close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Awaitable, Callable, Optional, Union

from cluster.config import WebSocketConfig
from cluster.core.events import Event
from cluster.core.turn.driver import TurnDriver
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.core.websocket.inflight import ReplicaHeld, WsCreate
from cluster.core.websocket.protocol import (
    MAX_ACTIVE,
    Action,
    Close,
    DeferredError,
    Enqueued,
    RunLane,
    SendError,
    SendEvent,
    State,
    WebSocketProtocol,
)
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.request_bounds import ReplicaQueue
from cluster.protocol.requests import admit_create

log = logging.getLogger(__name__)
# How long a server close may take to go out (its error, then its close frame, half each). The
# adapter's own sends cut a client that reads nothing sooner (`websocket.send_stall_seconds`, 10 s).
CLOSE_TIMEOUT_S = 24.0

Send = Callable[[Event], Awaitable[None]]
CloseSocket = Callable[[int, str], Awaitable[None]]


@dataclass
class ReplicaShared:
    """What every socket of one replica shares: the bounds on what waits and is held across them,
    the per-tenant gate for large creates, and the store's settling before a server close."""

    queue: Optional[ReplicaQueue] = None  # bytes of creates waiting on every socket's lanes
    held: Optional[ReplicaHeld] = None  # steering input and injected outputs across its sockets
    heavy: Optional["TenantGate"] = None  # one large create starting at a time per tenant
    # Waits for these responses' post-work (their store writes) before a close tells the client
    # to reconnect: the replica it reconnects to reads its `previous_response_id` from the store.
    settle: Optional[Callable[[list[str]], Awaitable[bool]]] = None


class WebSocketSession:
    def __init__(
        self,
        driver: TurnDriver,
        scope: TurnScope,
        *,
        config: WebSocketConfig,
        send: Send,
        close: CloseSocket,
        admit: Optional[Callable[[int], None]] = None,
        charge: Optional[Callable[[int], None]] = None,
        betas: frozenset[str] = frozenset(),
        shared: Optional[ReplicaShared] = None,
    ) -> None:
        if scope.transport != "websocket":
            raise ValueError("a WebSocket session's turns need a scope with transport='websocket'")
        shared = shared or ReplicaShared()
        self.driver = driver
        self.scope = scope  # every turn's: its cache, session key, tenant, lookup, trace parent
        self.cache = scope.cache
        self.session_key = scope.session_key
        self.config = config
        self.protocol = WebSocketProtocol(config, model_name=driver.model_name,
                                          max_input_items=driver.settings.max_input_items, cache=scope.cache,
                                          now=time.monotonic(), sampling=driver.settings.sampling_defaults,
                                          replica_queue=shared.queue, admit=admit, replica_held=shared.held,
                                          charge=charge)
        self._send = send
        self._close = close
        self._admit = admit  # per-key rate limits for each response.create, told its bytes (raises ApiError)
        self._betas = betas  # `OpenAI-Beta` values on the upgrade (multi-agent responses need theirs)
        self._settle = shared.settle
        self._heavy = shared.heavy
        self._closing = self._close_sent = False
        self._timer: Optional[asyncio.Task] = None
        self._lane_tasks: dict[str, asyncio.Task] = {}
        self._slots = asyncio.Semaphore(MAX_ACTIVE)
        self.responses = 0
        # A turn of this socket reached the engine path: only then is the session's KV its to free (anyone
        # of the tenant may open a socket naming someone's `x-session-id` and close it at once).
        self.ran = False

    @property
    def stored(self) -> bool:
        """A response of this socket was stored: closing it must not free the session's engine KV."""
        return self.protocol.stored

    def start(self) -> None:
        self._timer = asyncio.create_task(self._tick(), name=f"ws-limit-{self.session_key}")

    async def on_frame(self, data: Union[str, bytes]) -> None:
        await self._perform(self.protocol.receive(data, time.monotonic(), time.perf_counter()))

    @property
    def closed(self) -> bool:
        """The close frame is out (or the client left). The protocol decides to close before the
        session has sent the closing error and frame (a drain first waits for the store): until
        then the socket's reader must keep the connection open."""
        return self._close_sent or self.protocol.state is State.CLOSED and not self._closing

    @property
    def busy(self) -> bool:
        """A response is running or waiting on some lane."""
        return self.protocol.busy

    async def shutdown(self) -> None:
        """The client went away: cancel the in-flight turns, drop what waited."""
        self.protocol.client_left()
        tasks = [self._timer, *self._lane_tasks.values()]
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
        for task in tasks:  # each turn's cleanup (engine abort, post-work) runs before this returns
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self.cache.clear()  # `store: false` states die with their socket; the replica bound gets them back

    async def drain(self) -> None:
        """The server is going away (scale-down): finish the turns in flight, then close (1001)."""
        await self._perform(self.protocol.drain())

    async def wait_idle(self) -> None:
        """For tests: until every lane is idle."""
        while self.busy:
            tasks = [t for t in self._lane_tasks.values() if not t.done()]
            if not tasks:
                return  # closed: what is left on the lanes will not run
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- performing the protocol's actions -------------------------------------------------
    async def _perform(self, actions: list[Action]) -> None:
        if any(isinstance(a, Close) for a in actions):
            await self._closing_with(actions)
            return
        for action in actions:
            await self._perform_one(action)

    async def _closing_with(self, actions: list[Action]) -> None:
        """The closing error and close frame. Every server close sends the client to reconnect
        (drain: 1001; the connection's lifetime: 1000), maybe to another replica that reads its
        `previous_response_id` from the store: this socket's last responses are stored before it is
        told to go. A lane sending to a client that reads nothing holds the socket's send: the close
        waited behind it for ever, and the socket stayed open (200,000 invalid frames through
        HAProxy). The lanes stop first, and each send of the close is bounded."""
        self._closing = True
        if self._settle is not None and self.protocol.finished:
            await self._settle(list(self.protocol.finished))
        await self._stop_lanes()
        try:
            for action in actions:
                try:
                    await asyncio.wait_for(self._perform_one(action), CLOSE_TIMEOUT_S / 2)
                except asyncio.TimeoutError:
                    log.warning("websocket close: a send took over %.0f s (the client reads nothing)", CLOSE_TIMEOUT_S / 2)
        finally:
            self._close_sent = True

    async def _perform_one(self, action: Action) -> None:
        if isinstance(action, SendEvent):
            await self._send_quietly(action.event)
        elif isinstance(action, SendError):
            await self._send_error(action.error, action.stream_id)
        elif isinstance(action, Enqueued):
            try:
                if action.announce is not None:
                    await self._send(action.announce)
            finally:  # a failed send (the client left) must not leave its lane waiting forever
                action.create.announced.set()
        elif isinstance(action, RunLane):
            task = self._lane_tasks.get(action.key)
            if task is None or task.done():
                self._lane_tasks[action.key] = asyncio.create_task(
                    self._run_lane(action.key), name=f"ws-lane-{self.session_key}-{action.key}")
        elif isinstance(action, Close):
            await self._close(action.code, action.reason)

    async def _stop_lanes(self) -> None:
        """Cancel the lanes still running (not the one closing, when a lane closes): the connection is ending."""
        tasks = [t for t in self._lane_tasks.values() if not t.done() and t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each turn's cleanup runs first

    async def _tick(self) -> None:
        while True:
            actions, wait = self.protocol.tick(time.monotonic())
            await self._perform(actions)
            if wait is None:
                return
            await asyncio.sleep(wait)

    async def _run_lane(self, key: str) -> None:
        try:
            while (item := self.protocol.next_on_lane(key)) is not None:
                if isinstance(item, DeferredError):
                    await self._send_error(item.error, item.stream_id)
                    continue
                create: Optional[WsCreate] = item
                try:
                    await item.announced.wait()
                    source = self.protocol.fork_source(item)
                    if source is not None:  # it continues a response another lane has not finished yet
                        await source.done.wait()
                    async with self._slots:
                        while create is not None:  # a steered response's successor runs next, in its slot
                            create = await self._turn(create)
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let one response kill the connection
                    log.exception("websocket response failed")
                    await self._send_error(server_error(), stream_id=item.stream_id)
                finally:
                    self.protocol.turn_ended(key, time.monotonic())
                # A create refused at once (an error, no engine call) never suspends: without this a
                # lane with a queue of them holds the event loop until it is empty (5 s, measured).
                await asyncio.sleep(0)
        finally:
            if self._lane_tasks.get(key) is asyncio.current_task():
                del self._lane_tasks[key]
        await self._perform(self.protocol.lane_stopped(key))

    async def _turn(self, create: WsCreate) -> Optional[WsCreate]:
        """Run one create; returns the successor a steer asked for (or None)."""
        try:
            return await self._run_create(create)
        finally:
            create.done.set()

    async def _run_create(self, create: WsCreate) -> Optional[WsCreate]:
        # Parsing, validating and resolving a large input holds the event loop (~50 ms for 10,000
        # items): one tenant starts one such create at a time on this replica, so others wait
        # behind one of its blocks, not behind one per socket it holds (16 of its sockets whose
        # lanes came free together parsed their held frames in one pass of the loop: 0.6 s).
        release = await self._heavy.enter(self.scope.owner or "") if self._heavy is not None and create.large else None
        error: Optional[ApiError] = None
        try:
            # A held frame is parsed here, its input's errors raised.
            body, keep_parent = self.protocol.begin_turn(create, create.start_body())
            # Its frame's bytes were charged as it arrived (the protocol): the request alone counts now.
            admit = None if create.admitted or self._admit is None else partial(self._admit, 0)
            req = admit_create(body, transport="websocket", admit=admit,
                               max_input_items=self.driver.settings.max_input_items, betas=self._betas,
                               depth_checked=True,  # the protocol bounded every frame's nesting as it parsed it
                               floor=self.driver.preparer.check_body_floor)
            self.protocol.turn_admitted(create, req, body)
            self.ran = True
            async for ev in self.driver.run(TurnRequest(
                req,
                self.scope,
                stream_id=req.stream_id,
                received_at=create.received_at,
                parsed_at=time.perf_counter(),
                response_id=create.response_id,
                announced=create.response_id is not None,  # the id came with its `response.queued`
                stop=create.stop,
                keep_parent=keep_parent,
                agent=create.inbox,
            )):
                if release is not None:  # its input is resolved and rendered: the heavy part is over
                    release = release()
                self.protocol.turn_event(create, ev)
                await self._send(ev)
            self.responses += 1
        except ApiError as err:
            error = err
        finally:
            if release is not None:
                release()
            successor, actions = self.protocol.turn_finished(create, error)
        await self._perform(actions)
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


class TenantGate:
    """Per tenant, one holder at a time, first come first served, across every socket of a
    replica. `enter` returns the release (it returns None, so `release = release()` clears it)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # holding or waiting: the lock goes with the last of them

    async def enter(self, tenant: str) -> Callable[[], None]:
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        self._users[tenant] = self._users.get(tenant, 0) + 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave(tenant)
            raise

        def release() -> None:
            lock.release()
            self._leave(tenant)

        return release

    def _leave(self, tenant: str) -> None:
        self._users[tenant] -= 1
        if not self._users[tenant]:
            del self._users[tenant], self._locks[tenant]

    def __len__(self) -> int:
        return len(self._locks)
