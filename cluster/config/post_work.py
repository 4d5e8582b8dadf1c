"""`post_work`: work after a response ends, retried, never in the turn's way."""

from __future__ import annotations

from pydantic import Field

from cluster.config.base import StrictModel


class PostWorkConfig(StrictModel):
    """Work after a response ends (store writes, usage, output tail checks): retried, never in the turn's way."""

    retries: int = Field(3, ge=0)
    """Attempts of a post-inference hook after its first failure."""
    backoff_s: float = Field(0.2, ge=0)
    """First backoff between attempts (doubling)."""
    hooks: list[str] = Field(default_factory=list)
    """Extra hooks: "package.module:factory"; factory(config) -> async hook(TurnRecord)."""

