"""WebSocket mode (PROTOCOL §5) as transport-free logic: frames in, events out.

The ASGI route feeds received frames to `on_frame` and gives `send`/`close`
callables; everything else (FIFO per connection, warm-up, errors that keep the
socket open, connection time limit, cancellation on disconnect) lives here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable, Optional, Union

from ..config import WebSocketConfig
from ..protocol.errors import ApiError, server_error
from ..protocol.requests import parse_request
from .session_cache import SessionCache
from .turn import Lookup, TurnDriver

log = logging.getLogger(__name__)

IGNORED_TYPES = frozenset({"response.processed", "response.append"})
Send = Callable[[dict[str, Any]], Awaitable[None]]
Close = Callable[[int, str], Awaitable[None]]


def frame_bytes(data: Union[str, bytes]) -> int:
    """A frame's size in bytes as it came over the wire (UTF-8 for text frames)."""
    if isinstance(data, bytes):
        return len(data)
    return len(data) if data.isascii() else len(data.encode())


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
        # Frames waiting for the connection's FIFO: (frame, or the error it earned; arrival time).
        self._queue: asyncio.Queue[tuple[Union[str, bytes, ApiError], float]] = asyncio.Queue()
        self._queued_bytes = 0
        self._worker: Optional[asyncio.Task] = None
        self._timer: Optional[asyncio.Task] = None
        self.busy = False
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
        if self._queue.qsize() >= cfg.max_queued_creates:
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

    async def shutdown(self) -> None:
        """The client went away: cancel the in-flight turn, drop the queue."""
        self.closed = True
        for task in (self._timer, self._worker):
            if task is not None and not task.done():
                task.cancel()
        for task in (self._timer, self._worker):
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_bytes = 0
        self.cache.clear()  # `store: false` states die with their socket; the replica bound gets them back

    async def drain(self) -> None:
        """The server is going away (scale-down): finish the turn in flight, then
        tell the client to reconnect (the connection-limit error it already
        handles) and close with 1001."""
        self.draining = self.expired = True
        if not self.busy and self._queue.empty():
            await self._expire()

    async def wait_idle(self) -> None:
        """For tests: until every queued frame has been handled."""
        await self._queue.join()

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
        while True:
            data, received_at = await self._queue.get()
            if not isinstance(data, ApiError):
                self._queued_bytes -= len(data)
            try:
                if self.expired:
                    await self._expire()
                    return
                self.busy = True
                await self._handle(data, received_at)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one frame kill the connection
                log.exception("websocket frame handling failed")
                await self._send_error(server_error())
            finally:
                self.busy = False
                self._last_activity = time.monotonic()
                self._queue.task_done()
            if self.expired and self._queue.empty():
                await self._expire()
                return

    async def _handle(self, data: Union[str, bytes, ApiError], received_at: Optional[float] = None) -> None:
        if isinstance(data, ApiError):
            await self._send_error(data)
            return
        try:
            event = json.loads(data)
        except (ValueError, RecursionError) as exc:
            reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            await self._send_error(ApiError(400, f"The message is not valid JSON: {reason}.", code="invalid_json"))
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            await self._send_error(
                ApiError(400, "Each message must be a JSON object with a 'type'.", param="type", code="missing_required_parameter")
            )
            return
        kind = event["type"]
        if kind in IGNORED_TYPES:
            return
        if kind != "response.create":
            await self._send_error(
                ApiError(400, f"Invalid event type '{kind}'. Supported: 'response.create'.", param="type", code="invalid_value")
            )
            return
        body = {k: v for k, v in event.items() if k != "type"}
        if isinstance(body.get("response"), dict) and "input" not in body:
            # Tolerate the nested form some clients send: {"type", "response": {...}}.
            body = {**body.pop("response"), **body}
        try:
            if self._admit is not None:
                self._admit()
            req = parse_request(body, max_input_items=self.driver.settings.max_input_items)
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
            ):
                await self._send(ev)
            self.responses += 1
        except ApiError as err:
            await self._send_error(err, stream_id=body.get("stream_id") if isinstance(body.get("stream_id"), str) else None)

    async def _send_error(self, err: ApiError, stream_id: Optional[str] = None) -> None:
        ev = err.ws_event()
        if stream_id:
            ev["stream_id"] = stream_id
        try:
            await self._send(ev)
        except Exception:  # the socket may be gone already
            pass
