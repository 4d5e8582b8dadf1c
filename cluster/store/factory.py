"""Open the configured store."""

from __future__ import annotations

from typing import Optional

from ..config import StoreConfig
from .base import ResponseStore


async def open_store(config: StoreConfig) -> Optional[ResponseStore]:
    if config.backend == "none":
        return None
    if config.backend == "postgres":
        from .postgres import PostgresStore

        store = PostgresStore(config.postgres_dsn)
    else:
        from .sqlite import SQLiteStore

        store = SQLiteStore(config.sqlite_path)
    await store.start()
    return store
