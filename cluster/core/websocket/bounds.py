"""What one WebSocket connection's frames may make a replica hold, beyond the socket's own
bounds: creates waiting on every socket's lanes (`ReplicaQueue`), steering input and injected
tool outputs across its sockets (`ReplicaHeld`), and a frame's size as the wire counts it."""

from __future__ import annotations

import time
from typing import Callable, Optional, Union

from cluster.protocol.errors import ApiError


class ReplicaQueue:
    """Bytes of creates waiting on every socket's lanes of one replica (shared by its sockets'
    protocols): a socket's own bound times the sockets a replica takes is no bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held = max(0, self.held - nbytes)


def frame_bytes(data: Union[str, bytes]) -> int:
    """A frame's size in bytes as it came over the wire (UTF-8 for text frames)."""
    if isinstance(data, bytes):
        return len(data)
    return len(data) if data.isascii() else len(data.encode())


def frame_too_large(size: int, limit: int) -> ApiError:
    # Codex knows this code (`websocket_message_too_large`); the frame is dropped, the socket stays.
    return ApiError(400, f"The message is {size} bytes; the limit is {limit} bytes.",
                    code="websocket_message_too_large")


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
