"""Stored items by id (`item_reference`), on the real databases: SQLite and PostgreSQL (127.0.0.1:5432).

Item ids in an input are the client's to choose, so two responses may carry the same id. Neither
may overwrite the other's item, and deleting one response never removes, nor keeps alive, the
other's (issue 22, item 10)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import uuid

import pytest

from cluster.store.base import StoredResponse
from cluster.store.postgres import PostgresStore
from cluster.store.sqlite import SQLiteStore

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def record(rid: str, tenant: str, *, inputs=(), output=()) -> StoredResponse:
    return StoredResponse(id=rid, tenant=tenant, previous_response_id=None, created_at=1.0, model="m",
                          input_items=list(inputs), output=list(output), response={"id": rid},
                          instructions=None, tools=[])


def msg(item_id: str, text: str) -> dict:
    return {"type": "message", "role": "user", "id": item_id, "content": [{"type": "input_text", "text": text}]}


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteStore(str(tmp_path / "store.db"))
        await s.start()
        yield s
        await s.close()
        return
    async with scratch_pg_database() as dsn:
        s = PostgresStore(dsn)
        try:
            await asyncio.wait_for(s.start(), 20)
            yield s
        finally:
            await s.close()


@contextlib.asynccontextmanager
async def scratch_pg_database():
    """A fresh PostgreSQL database for one test, dropped afterwards; yields its DSN."""
    import asyncpg

    name = f"loopserve_unit_{uuid.uuid4().hex[:10]}"
    admin = await asyncio.wait_for(asyncpg.connect(PG_ADMIN), 10)
    await admin.execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name}")
        await admin.close()


async def assert_v3_item_migrated(s) -> None:
    """A version-3 row (`msg_old` of `resp_old`) is readable after the migration, and a later
    response that reuses its id and is deleted leaves it in place."""
    await asyncio.wait_for(s.start(), 20)
    try:
        assert await s.get_item("msg_old", "t") == {"type": "message"}
        await s.put(record("resp_new", "t", inputs=[msg("msg_old", "new")]))
        assert await s.delete("resp_new", "t")
        assert await s.get_item("msg_old", "t") == {"type": "message"}
    finally:
        await s.close()


async def test_a_later_response_with_the_same_item_id_overwrites_nothing(store):
    await store.put(record("resp_a", "t", output=[msg("msg_1", "from a")]))
    await store.put(record("resp_b", "t", inputs=[msg("msg_1", "from b")]))
    assert (await store.get_item("msg_1", "t"))["content"][0]["text"] == "from b"  # the newest copy
    assert await store.delete("resp_b", "t")
    # a's item is still there for a (SQLite used to delete it with b's row)
    assert (await store.get_item("msg_1", "t"))["content"][0]["text"] == "from a"
    assert await store.delete("resp_a", "t")
    # nothing deleted stays referenceable (PostgreSQL used to keep the row under a's id)
    assert await store.get_item("msg_1", "t") is None


async def test_items_stay_in_their_tenant(store):
    await store.put(record("resp_a", "a", output=[msg("msg_1", "secret")]))
    await store.put(record("resp_b", "b", inputs=[msg("msg_1", "mine")]))
    assert (await store.get_item("msg_1", "a"))["content"][0]["text"] == "secret"
    assert await store.delete("resp_b", "b")
    assert await store.get_item("msg_1", "b") is None
    assert await store.get_item("msg_1", "default") is None


async def test_rewriting_a_response_keeps_one_copy_of_its_items(store):
    await store.put(record("resp_a", "t", output=[msg("msg_1", "v1")]))
    await store.put(record("resp_a", "t", output=[msg("msg_1", "v2")]))  # the post-work retry, or a late flag
    assert (await store.get_item("msg_1", "t"))["content"][0]["text"] == "v2"
    assert await store.delete("resp_a", "t")
    assert await store.get_item("msg_1", "t") is None


async def test_a_version_3_sqlite_store_is_migrated(tmp_path):
    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE loopserve_schema (version INTEGER NOT NULL)")
    db.execute("INSERT INTO loopserve_schema VALUES (3)")
    db.execute("""CREATE TABLE responses (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, previous_response_id TEXT, created_at REAL NOT NULL,
        model TEXT NOT NULL, input_items TEXT NOT NULL, output TEXT NOT NULL, response TEXT NOT NULL,
        instructions TEXT, tools TEXT NOT NULL, affinity_key TEXT, blocked TEXT)""")
    db.execute("""CREATE TABLE response_items (tenant TEXT NOT NULL, item_id TEXT NOT NULL,
        response_id TEXT NOT NULL, item TEXT NOT NULL, PRIMARY KEY (tenant, item_id))""")
    db.execute("INSERT INTO response_items VALUES ('t', 'msg_old', 'resp_old', '{\"type\": \"message\"}')")
    db.commit()
    db.close()
    await assert_v3_item_migrated(SQLiteStore(path))
    tables = {r[0] for r in sqlite3.connect(path).execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "response_items" not in tables and os.path.exists(path)


async def test_a_version_3_postgres_store_is_migrated():
    import asyncpg

    from cluster.store.postgres import MIGRATIONS

    async with scratch_pg_database() as dsn:
        old = await asyncpg.connect(dsn)
        await old.execute("CREATE TABLE loopserve_schema (version INTEGER NOT NULL)")
        for number, steps in enumerate(MIGRATIONS[:3], start=1):  # the schema as version 3 left it
            for stmt in steps:
                await old.execute(stmt)
            await old.execute("INSERT INTO loopserve_schema VALUES ($1)", number)
        await old.execute("INSERT INTO response_items VALUES ('t', 'msg_old', 'resp_old', '{\"type\": \"message\"}')")
        await old.close()
        await assert_v3_item_migrated(PostgresStore(dsn))
