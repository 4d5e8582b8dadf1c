"""Open the configured store."""

from __future__ import annotations

import os
from typing import Optional

from cluster.config import StoreConfig
from cluster.store.base import ResponseStore


async def open_store(config: StoreConfig) -> Optional[ResponseStore]:
    if config.backend == "none":
        return None
    if config.backend == "postgres":
        from cluster.store.postgres import PostgresStore

        dsn = config.postgres_dsn
        if config.postgres_dsn_env:
            dsn = os.environ.get(config.postgres_dsn_env, "")
            if not dsn:
                raise ValueError(f"store.postgres_dsn_env names {config.postgres_dsn_env!r}, which is not set here")
        store = PostgresStore(dsn)
    else:
        from cluster.store.sqlite import SQLiteStore

        store = SQLiteStore(config.sqlite_path)
    await store.start()
    return store
