"""What the WebSocket protocol asks its session to do (send, run a lane, close), and a frame's
error waiting for its place in the FIFO."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

from cluster.config import WebSocketConfig
from cluster.core.events import Event
from cluster.core.websocket.inflight import WsCreate
from cluster.protocol.errors import ApiError


# -- actions --------------------------------------------------------------------------


@dataclass(frozen=True)
class SendEvent:
    event: Event


@dataclass(frozen=True)
class SendError:
    error: ApiError
    stream_id: Optional[str] = None


@dataclass(frozen=True)
class Enqueued:
    """A create is on its lane: send `announce` (its `response.queued`, when it has to wait)
    before the lane may start it, then mark it announced."""

    create: WsCreate
    announce: Optional[Event]


@dataclass(frozen=True)
class RunLane:
    """The lane has work: run it unless it is running already."""

    key: str


@dataclass(frozen=True)
class Close:
    code: int
    reason: str


Action = Union[SendEvent, SendError, Enqueued, RunLane, Close]


@dataclass(frozen=True)
class DeferredError:
    """A frame's error waiting for its place in the FIFO (on the default lane)."""

    error: ApiError
    stream_id: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return 256 + len(self.error.message) + len(self.error.param or "")  # it may quote the client


class End(enum.Enum):
    LIFETIME = "lifetime"
    IDLE = "idle"
    DRAIN = "drain"
    FLOOD = "flood"


def closing(why: "End | None", config: WebSocketConfig) -> list[Action]:
    """The error and close frame that end a connection, for the reason it ends."""
    if why is End.FLOOD:
        return [SendError(ApiError(400, f"Too many invalid messages: more than {config.max_queued_creates} "
                                        "waiting for their errors to be read, or more errors and failed events "
                                        f"than {config.max_error_bytes_per_minute} bytes a minute; closing this "
                                        "connection.", code="too_many_errors")),
                Close(1008, "too many errors not read")]
    if why is End.DRAIN:
        message = ("This server is shutting down this connection (scale-down or restart). "
                   "Create a new websocket connection to continue.")
    elif why is End.IDLE:
        message = (f"This websocket connection was closed after {config.idle_timeout_seconds:.0f} "
                   "seconds without activity. Create a new websocket connection to continue.")
    else:
        message = (f"Responses websocket connection limit reached ({_duration(config.max_connection_seconds)}). "
                   "Create a new websocket connection to continue.")
    error = SendError(ApiError(400, message, code="websocket_connection_limit_reached"))
    return [error, Close(1001, "server draining: reconnect") if why is End.DRAIN
            else Close(1000, "connection limit reached")]


def _duration(seconds: float) -> str:
    """A configured lifetime as OpenAI words its own limit ("60 minutes" for 3,600 s)."""
    if seconds >= 60 and seconds % 60 == 0:
        minutes = int(seconds // 60)
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    return f"{seconds:g} seconds"
