"""What a socket's frames weigh: their size on the wire, the error for one too large, and the
bytes every socket of a replica may have waiting together."""

from __future__ import annotations

from typing import Union

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
