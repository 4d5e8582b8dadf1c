"""`store`: where `store: true` responses live beyond memory."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from cluster.config.base import StrictModel


class StoreConfig(StrictModel):
    """Where `store: true` responses live beyond memory."""

    backend: Literal["sqlite", "postgres", "none"] = "sqlite"
    """`sqlite`, `postgres`, or `none` (responses live in replica memory only)."""
    sqlite_path: str = str(Path.home() / ".cache" / "loopserve" / "responses.sqlite3")
    """The SQLite file (one per node)."""
    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    """The PostgreSQL DSN (prefer `postgres_dsn_env` where the DSN holds a password)."""
    postgres_dsn_env: Optional[str] = None
    """The name of an environment variable holding the DSN instead (a Kubernetes Secret's `secretKeyRef`): the
    password never sits in the config. Read where the store opens."""
    write_retry_s: float = Field(60.0, ge=0)
    """Writes are post-inference work: a failed write is retried with backoff for this long (the store restarting,
    a failover), then counted in `/loopserve/stats` (`store_writes.failed`) and logged with the response id; the
    response stays readable and continuable from this replica's memory."""

