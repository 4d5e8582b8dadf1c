"""What the WebSocket protocol asks its session to do (send, run a lane, close), and a frame's
error waiting for its place in the FIFO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

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
