"""`websocket`: WebSocket mode, what one socket may hold and how long it lives."""

from __future__ import annotations

from pydantic import Field

from cluster.config.base import StrictModel


class WebSocketConfig(StrictModel):
    """WebSocket mode (`/v1/responses` upgraded): what one socket may hold and how long it lives."""

    max_connection_seconds: float = 3600.0
    """A socket's life: then it is told to reconnect (`websocket_connection_limit_reached`) after its turn in flight."""
    idle_timeout_seconds: float = Field(900.0, gt=0)
    """A socket with no frame and no turn in flight for this long is closed (error event + close 1000), freeing its
    cache."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Browser clients: when set, a request or upgrade whose Origin header is not listed is refused (403). Unset, a
    server without API keys admits only pages served from localhost (any page its user visits could drive it
    otherwise); with keys, any Origin. Requests without an Origin (SDKs, CLIs) are not affected."""
    send_stall_seconds: float = Field(10.0, gt=0)
    """A send the client takes nothing of for this long (the socket's buffers, megabytes, full: it reads nothing) cuts
    the connection (a TCP reset, no close handshake: the close frame would wait behind what it has not read). Keep it
    under 12 s: a server close's error and frame get 12 s each."""
    max_frame_bytes: int = 15 * 1024 * 1024
    """Frames above this get an error event (the proxy itself closes above 16 MiB)."""
    max_frame_bytes_per_minute: int = Field(48 * 1024 * 1024, ge=1024 * 1024)
    """Bytes of frames one socket may send a minute, every type (a token bucket), charged before a frame is read
    (and to its key's `input_bytes_per_minute` as well, which bounds a key's sockets together): reading a frame
    holds the replica's event loop by the byte, up to ~64 ms a MiB for the worst shapes. Past it a frame is
    dropped with a 429, and a client that keeps sending spends its error budget and is closed."""
    max_queued_creates: int = 64
    """Creates and unread errors one socket may have waiting; more are refused at once (429)."""
    max_queued_bytes: int = 32 * 1024 * 1024
    """Bytes creates waiting behind the responses in flight on one socket hold, parsed (a frame of small items
    holds ~10x its size once parsed)."""
    max_error_bytes_per_minute: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    """Bytes of errors and failed steers/injects (which return their input) the server may send one socket a
    minute (a token bucket); past it the socket is closed (1008 `too_many_errors`). Holds whether the ingress
    applies back-pressure or not (Serve's Python proxy does not)."""
    max_replica_held_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024)
    """Steering input and injected tool outputs held on all sockets of one connection replica together (each
    socket: 4 MiB and 16 MiB); past it a steer fails (`too_many_pending_steers`) and an inject is refused
    (`inject_limit_reached`)."""
    max_replica_queued_bytes: int = Field(512 * 1024 * 1024, ge=1024 * 1024)
    """The same, summed over every socket of one connection replica: past it a create is refused at once (429),
    whatever socket it came on."""
    agent_wait_seconds: float = Field(300.0, gt=0)
    """A multi-agent response (beta) waits this long for `response.inject` to answer its tool calls; then it ends
    as it stands (completed, the calls left for a normal continuation)."""

