"""`cache`: response state kept in memory for continuations."""

from __future__ import annotations

from cluster.config.base import StrictModel


class CacheConfig(StrictModel):
    """Response state kept in memory for continuations (`previous_response_id`): per socket and replica-wide."""

    max_entries: int = 64
    """Per WebSocket connection."""
    max_bytes: int = 256 * 1024 * 1024
    """Per WebSocket connection, in bytes of response state."""
    connections_max_bytes: int = 2 * 1024 * 1024 * 1024
    """All connections' caches on one replica together: past this, the caches of the least recently used
    connections are emptied (their next continuation is `previous_response_not_found` with `store: false`, or a
    store load)."""
    replica_max_entries: int = 4096
    """Replica-wide cache of `store: true` responses, for HTTP continuations."""
    replica_max_bytes: int = 1024 * 1024 * 1024
    """The replica-wide cache of `store: true` responses, in bytes."""

