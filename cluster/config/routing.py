"""`routing`: how engine requests find a replica."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cluster.config.base import StrictModel


class RoutingConfig(StrictModel):
    """How engine requests find a replica.

    `session_affinity`: Ray Serve's ConsistentHashRouter on the session key, so
    every turn of a session reaches the replica holding its prefix KV; when that
    replica dies the session moves (next turn = full prefill there).
    """

    policy: Literal["session_affinity", "least_loaded"] = "session_affinity"
    """`session_affinity` (consistent hash on the session key) or `least_loaded` (Serve's default router)."""
    num_virtual_nodes: int = Field(100, ge=1)
    """Points per replica on the consistent-hash ring."""
    num_fallback_replicas: int = Field(1, ge=0)
    """Successors tried when the session's replica rejects under backpressure."""
    engine_retries: int = Field(5, ge=0)
    """Retries of an engine call that failed before its first chunk (replica died). backoff 0.5 s, 1 s, ...: ~7.5 s
    covers a replica restart."""

