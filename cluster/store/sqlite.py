"""SQLite store: the embedded default (one machine, zero set-up)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
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

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS loopserve_schema (version INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, previous_response_id TEXT, created_at REAL NOT NULL,
        model TEXT NOT NULL, input_items TEXT NOT NULL, output TEXT NOT NULL, response TEXT NOT NULL,
        instructions TEXT, tools TEXT NOT NULL, affinity_key TEXT, blocked TEXT, engine_replica TEXT,
        compacted INTEGER NOT NULL DEFAULT 0)""",
    """CREATE INDEX IF NOT EXISTS responses_tenant ON responses (tenant, id)""",
    *items_table("INTEGER PRIMARY KEY AUTOINCREMENT"),
    *conversation_tables("INTEGER PRIMARY KEY AUTOINCREMENT", "REAL"),
]
CONVERSATIONS = Sql(positional=False)

CHAIN = chain_query("?", "?")
PLACEHOLDERS = ",".join("?" * COLUMN_COUNT)


class SQLiteStore:
    def __init__(self, path: str) -> None:
        self.path = path
        self._db: Optional[sqlite3.Connection] = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        def open_db() -> sqlite3.Connection:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            for stmt in SCHEMA:
                db.execute(stmt)
            if db.execute("SELECT count(*) FROM loopserve_schema").fetchone()[0] == 0:
                db.execute("INSERT INTO loopserve_schema VALUES (1)")
            columns = {row[1] for row in db.execute("PRAGMA table_info(responses)")}
            if "blocked" not in columns:  # version 1 -> 2
                db.execute("ALTER TABLE responses ADD COLUMN blocked TEXT")
            if "engine_replica" not in columns:  # version 4 -> 5: the chain's engine placement
                db.execute("ALTER TABLE responses ADD COLUMN engine_replica TEXT")
            if "compacted" not in columns:  # version 5 -> 6: a chain's walk stops at a compaction
                db.execute("ALTER TABLE responses ADD COLUMN compacted INTEGER NOT NULL DEFAULT 0")
                db.execute(BACKFILL_COMPACTED)
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if LEGACY_ITEMS_TABLE in tables:  # version 3 -> 4: a row per (response, item)
                with db:
                    db.execute("BEGIN")
                    for stmt in MIGRATE_LEGACY_ITEMS:
                        db.execute(stmt)
            db.execute("UPDATE loopserve_schema SET version = 7")  # 6 -> 7: conversations (CREATE IF NOT EXISTS above)
            return db

        self._db = await asyncio.to_thread(open_db)

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    async def _run(self, fn):
        async with self._lock:  # one connection; writes are off the critical path anyway
            return await asyncio.to_thread(fn, self._db)

    async def put(self, record: StoredResponse) -> None:
        def write(db: sqlite3.Connection) -> None:
            with db:  # one transaction: the response and its items
                db.execute("BEGIN")
                db.execute(f"INSERT OR REPLACE INTO responses ({COLUMNS}) VALUES ({PLACEHOLDERS})",
                           record.row())
                db.executemany(f"INSERT OR REPLACE INTO {ITEMS_TABLE_NAME} (tenant, item_id, response_id, item) "
                               "VALUES (?,?,?,?)", record.item_rows())

        await self._run(write)

    async def get_item(self, item_id: str, tenant: str) -> Optional[dict]:
        row = await self._run(lambda db: db.execute(
            f"SELECT item FROM {ITEMS_TABLE_NAME} WHERE item_id = ? AND tenant = ? ORDER BY seq DESC LIMIT 1",
            (item_id, tenant)).fetchone())
        return json.loads(row[0]) if row else None

    async def get(self, response_id: str, tenant: str) -> Optional[StoredResponse]:
        row = await self._run(lambda db: db.execute(
            f"SELECT {COLUMNS} FROM responses WHERE id = ? AND tenant = ?", (response_id, tenant)).fetchone())
        return StoredResponse.from_row(row) if row else None

    async def chain(self, response_id: str, tenant: str) -> Optional[StoredChain]:
        last = await self.get(response_id, tenant)
        if last is None:
            return None
        rows = await self._run(lambda db: db.execute(CHAIN, (response_id, tenant)).fetchall())
        links = [link_from_row(r) for r in rows]
        return StoredChain(links, last) if links else None

    async def mark_blocked(self, response_id: str, tenant: str, blocked: dict) -> bool:
        cur = await self._run(lambda db: db.execute(
            "UPDATE responses SET blocked = ? WHERE id = ? AND tenant = ?", (json.dumps(blocked), response_id, tenant)))
        return cur.rowcount > 0

    async def delete(self, response_id: str, tenant: str) -> bool:
        def remove(db: sqlite3.Connection) -> int:
            with db:
                db.execute("BEGIN")
                db.execute(f"DELETE FROM {ITEMS_TABLE_NAME} WHERE response_id = ? AND tenant = ?",
                           (response_id, tenant))
                return db.execute("DELETE FROM responses WHERE id = ? AND tenant = ?",
                                  (response_id, tenant)).rowcount

        return await self._run(remove) > 0

    # -- conversations ------------------------------------------------------------
    async def put_conversation(self, conversation: StoredConversation, items: list[dict]) -> None:
        def write(db: sqlite3.Connection) -> None:
            with db:
                db.execute("BEGIN")
                db.execute(CONVERSATIONS.insert, conversation.row())
                db.executemany(CONVERSATIONS.add_item, item_rows(conversation.id, conversation.tenant, items))

        await self._run(write)

    async def get_conversation(self, conversation_id: str, tenant: str) -> Optional[StoredConversation]:
        row = await self._run(lambda db: db.execute(CONVERSATIONS.get, (conversation_id, tenant)).fetchone())
        return StoredConversation.from_row(row) if row else None

    async def set_conversation_metadata(self, conversation_id: str, tenant: str, metadata: dict) -> bool:
        cur = await self._run(lambda db: db.execute(CONVERSATIONS.set_metadata,
                                                    (json.dumps(metadata), conversation_id, tenant)))
        return cur.rowcount > 0

    async def delete_conversation(self, conversation_id: str, tenant: str) -> bool:
        def remove(db: sqlite3.Connection) -> int:
            with db:
                db.execute("BEGIN")
                db.execute(CONVERSATIONS.delete_items, (conversation_id, tenant))
                return db.execute(CONVERSATIONS.delete, (conversation_id, tenant)).rowcount

        return await self._run(remove) > 0

    async def append_conversation_items(self, conversation_id: str, tenant: str, items: list[dict],
                                        head_response_id: Optional[str] = None) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            with db:
                db.execute("BEGIN")
                row = db.execute(CONVERSATIONS.bump, (len(items), conversation_id, tenant)).fetchone()
                if row is None:
                    return False
                db.executemany(CONVERSATIONS.add_item, item_rows(conversation_id, tenant, items))
                if head_response_id is not None:
                    db.execute(CONVERSATIONS.set_head, (head_response_id, row[0], conversation_id, tenant))
                return True

        return await self._run(write)

    async def conversation_item(self, conversation_id: str, tenant: str, item_id: str) -> Optional[tuple[int, dict]]:
        row = await self._run(lambda db: db.execute(CONVERSATIONS.get_item,
                                                    (conversation_id, tenant, item_id)).fetchone())
        return (int(row[0]), json.loads(row[1])) if row else None

    async def conversation_items(self, conversation_id: str, tenant: str, *, after_seq: Optional[int] = None,
                                 limit: int, order: str = "asc") -> list[tuple[int, dict]]:
        sql = CONVERSATIONS.page_asc if order == "asc" else CONVERSATIONS.page_desc
        start = after_seq if after_seq is not None else (FIRST_SEQ if order == "asc" else LAST_SEQ)
        rows = await self._run(lambda db: db.execute(sql, (conversation_id, tenant, start, limit)).fetchall())
        return [(int(r[0]), json.loads(r[1])) for r in rows]

    async def delete_conversation_item(self, conversation_id: str, tenant: str, item_id: str) -> bool:
        def remove(db: sqlite3.Connection) -> bool:
            with db:
                db.execute("BEGIN")
                row = db.execute(CONVERSATIONS.get_item, (conversation_id, tenant, item_id)).fetchone()
                if row is None:
                    return False
                db.execute(CONVERSATIONS.delete_item, (row[0],))
                db.execute(CONVERSATIONS.bump, (1, conversation_id, tenant)).fetchone()
                return True

        return await self._run(remove)
