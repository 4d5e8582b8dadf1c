"""PostgreSQL store (multi-node): asyncpg pool, schema created/migrated on start."""

from __future__ import annotations

from typing import Optional

from cluster.store.base import (
    COLUMNS,
    ITEMS_TABLE_NAME,
    LEGACY_ITEMS_TABLE,
    MIGRATE_LEGACY_ITEMS,
    StoredChain,
    StoredResponse,
    BACKFILL_COMPACTED,
    COLUMN_COUNT,
    chain_query,
    link_from_row,
    items_table,
)
from cluster.store.conversations import FIRST_SEQ, LAST_SEQ, Sql, StoredConversation, conversation_tables, item_rows

MIGRATIONS = [
    # version 1
    [
        """CREATE TABLE IF NOT EXISTS responses (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL, previous_response_id TEXT,
            created_at DOUBLE PRECISION NOT NULL, model TEXT NOT NULL, input_items TEXT NOT NULL,
            output TEXT NOT NULL, response TEXT NOT NULL, instructions TEXT, tools TEXT NOT NULL,
            affinity_key TEXT)""",
        "CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant, id)",
    ],
    # version 2: why a response may not be continued (durable across restarts)
    ["ALTER TABLE responses ADD COLUMN IF NOT EXISTS blocked TEXT"],
    # version 3: items by id (item_reference inputs), keyed by (tenant, item id)
    [f"""CREATE TABLE IF NOT EXISTS {LEGACY_ITEMS_TABLE} (
        tenant TEXT NOT NULL, item_id TEXT NOT NULL, response_id TEXT NOT NULL, item TEXT NOT NULL,
        PRIMARY KEY (tenant, item_id))"""],
    # version 4: a row per (response, item): a client-chosen id can't overwrite another response's item
    [*items_table("BIGSERIAL PRIMARY KEY"), *MIGRATE_LEGACY_ITEMS],
    # version 5: the engine replica holding the chain's prefix (its placement, for every connection replica)
    ["ALTER TABLE responses ADD COLUMN IF NOT EXISTS engine_replica TEXT"],
    # version 6: whether a response compacted its context (a chain's walk stops there)
    ["ALTER TABLE responses ADD COLUMN IF NOT EXISTS compacted INTEGER NOT NULL DEFAULT 0", BACKFILL_COMPACTED],
    # version 7: conversations and their items
    conversation_tables("BIGSERIAL PRIMARY KEY", "DOUBLE PRECISION"),
]
CONVERSATIONS = Sql(positional=True)

CHAIN = chain_query("$1", "$2")
PLACEHOLDERS = ",".join(f"${i}" for i in range(1, COLUMN_COUNT + 1))


class PostgresStore:
    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 8) -> None:
        self.dsn = dsn
        self.min_size, self.max_size = min_size, max_size
        self._pool = None

    async def start(self) -> None:
        import asyncpg

        self._pool = await asyncpg.create_pool(self.dsn, min_size=self.min_size, max_size=self.max_size)
        async with self._pool.acquire() as conn:
            # Serialize migrations across replicas starting at once.
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(771177)")
                await conn.execute("CREATE TABLE IF NOT EXISTS loopserve_schema (version INTEGER NOT NULL)")
                version = await conn.fetchval("SELECT max(version) FROM loopserve_schema") or 0
                for number, steps in enumerate(MIGRATIONS[version:], start=version + 1):
                    for stmt in steps:
                        await conn.execute(stmt)
                    await conn.execute("INSERT INTO loopserve_schema VALUES ($1)", number)

    async def close(self) -> None:
        if self._pool is not None:
            import asyncio

            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), 5)
            except (asyncio.TimeoutError, Exception):  # a broken server must not hold a shutdown
                pool.terminate()

    async def put(self, record: StoredResponse) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(
                f"""INSERT INTO responses ({COLUMNS}) VALUES ({PLACEHOLDERS})
                    ON CONFLICT (id) DO UPDATE SET response = EXCLUDED.response, output = EXCLUDED.output,
                    compacted = EXCLUDED.compacted,
                    blocked = COALESCE(EXCLUDED.blocked, responses.blocked)""",
                *record.row(),
            )
            await conn.executemany(
                f"""INSERT INTO {ITEMS_TABLE_NAME} (tenant, item_id, response_id, item) VALUES ($1,$2,$3,$4)
                    ON CONFLICT (tenant, response_id, item_id) DO UPDATE SET item = EXCLUDED.item""",
                record.item_rows())

    async def get_item(self, item_id: str, tenant: str) -> Optional[dict]:
        import json

        item = await self._pool.fetchval(
            f"SELECT item FROM {ITEMS_TABLE_NAME} WHERE item_id = $1 AND tenant = $2 ORDER BY seq DESC LIMIT 1",
            item_id, tenant)
        return json.loads(item) if item is not None else None

    async def get(self, response_id: str, tenant: str) -> Optional[StoredResponse]:
        row = await self._pool.fetchrow(f"SELECT {COLUMNS} FROM responses WHERE id = $1 AND tenant = $2",
                                        response_id, tenant)
        return StoredResponse.from_row(row) if row else None

    async def chain(self, response_id: str, tenant: str) -> Optional[StoredChain]:
        last = await self.get(response_id, tenant)
        if last is None:
            return None
        links = [link_from_row(r) for r in await self._pool.fetch(CHAIN, response_id, tenant)]
        return StoredChain(links, last) if links else None

    async def mark_blocked(self, response_id: str, tenant: str, blocked: dict) -> bool:
        import json

        result = await self._pool.execute("UPDATE responses SET blocked = $1 WHERE id = $2 AND tenant = $3",
                                          json.dumps(blocked), response_id, tenant)
        return result.endswith(" 1")

    async def delete(self, response_id: str, tenant: str) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(f"DELETE FROM {ITEMS_TABLE_NAME} WHERE response_id = $1 AND tenant = $2",
                               response_id, tenant)
            result = await conn.execute("DELETE FROM responses WHERE id = $1 AND tenant = $2", response_id, tenant)
        return result.endswith(" 1")

    # -- conversations ------------------------------------------------------------
    async def put_conversation(self, conversation: StoredConversation, items: list[dict]) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(CONVERSATIONS.insert, *conversation.row())
            await conn.executemany(CONVERSATIONS.add_item, item_rows(conversation.id, conversation.tenant, items))

    async def get_conversation(self, conversation_id: str, tenant: str) -> Optional[StoredConversation]:
        row = await self._pool.fetchrow(CONVERSATIONS.get, conversation_id, tenant)
        return StoredConversation.from_row(row) if row else None

    async def set_conversation_metadata(self, conversation_id: str, tenant: str, metadata: dict) -> bool:
        import json

        result = await self._pool.execute(CONVERSATIONS.set_metadata, json.dumps(metadata), conversation_id, tenant)
        return result.endswith(" 1")

    async def delete_conversation(self, conversation_id: str, tenant: str) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(CONVERSATIONS.delete_items, conversation_id, tenant)
            result = await conn.execute(CONVERSATIONS.delete, conversation_id, tenant)
        return result.endswith(" 1")

    async def append_conversation_items(self, conversation_id: str, tenant: str, items: list[dict],
                                        head_response_id: Optional[str] = None) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            version = await conn.fetchval(CONVERSATIONS.bump, len(items), conversation_id, tenant)
            if version is None:
                return False
            await conn.executemany(CONVERSATIONS.add_item, item_rows(conversation_id, tenant, items))
            if head_response_id is not None:
                await conn.execute(CONVERSATIONS.set_head, head_response_id, version, conversation_id, tenant)
        return True

    async def conversation_item(self, conversation_id: str, tenant: str, item_id: str) -> Optional[tuple[int, dict]]:
        import json

        row = await self._pool.fetchrow(CONVERSATIONS.get_item, conversation_id, tenant, item_id)
        return (int(row[0]), json.loads(row[1])) if row else None

    async def conversation_items(self, conversation_id: str, tenant: str, *, after_seq: Optional[int] = None,
                                 limit: int, order: str = "asc") -> list[tuple[int, dict]]:
        import json

        sql = CONVERSATIONS.page_asc if order == "asc" else CONVERSATIONS.page_desc
        start = after_seq if after_seq is not None else (FIRST_SEQ if order == "asc" else LAST_SEQ)
        rows = await self._pool.fetch(sql, conversation_id, tenant, start, limit)
        return [(int(r[0]), json.loads(r[1])) for r in rows]

    async def delete_conversation_item(self, conversation_id: str, tenant: str, item_id: str) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(CONVERSATIONS.get_item, conversation_id, tenant, item_id)
            if row is None:
                return False
            await conn.execute(CONVERSATIONS.delete_item, row[0])
            await conn.fetchval(CONVERSATIONS.bump, 1, conversation_id, tenant)
        return True
