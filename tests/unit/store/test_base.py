"""Stored items by id (`item_reference`), on the real databases: SQLite and PostgreSQL (127.0.0.1:5432).

Item ids in an input are the client's to choose, so two responses may carry the same id. Neither
may overwrite the other's item, and deleting one response never removes, nor keeps alive, the
other's."""

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


def old_sqlite(path: str, version: int, later_columns: str) -> sqlite3.Connection:
    """A SQLite store as schema `version` left it (its responses table's later columns given)."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE loopserve_schema (version INTEGER NOT NULL)")
    db.execute(f"INSERT INTO loopserve_schema VALUES ({version})")
    db.execute(f"""CREATE TABLE responses (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, previous_response_id TEXT, created_at REAL NOT NULL,
        model TEXT NOT NULL, input_items TEXT NOT NULL, output TEXT NOT NULL, response TEXT NOT NULL,
        instructions TEXT, tools TEXT NOT NULL, affinity_key TEXT, {later_columns})""")
    return db


async def test_a_version_3_sqlite_store_is_migrated(tmp_path):
    path = str(tmp_path / "old.db")
    db = old_sqlite(path, 3, "blocked TEXT")
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


def linked(rid: str, prev, *, inputs=(), output=(), tools=()) -> StoredResponse:
    rec = record(rid, "t", inputs=inputs, output=output)
    rec.previous_response_id, rec.tools, rec.response = prev, list(tools), {"id": rid, "tools": list(tools)}
    return rec


COMPACTION = {"type": "compaction", "id": "cmp_1", "encrypted_content": "ls1.k.x"}


async def test_a_chain_reads_its_ancestors_input_and_output_only_from_the_nearest_compaction(store):
    """A GET or continuation of an evicted response loads what its context needs: not every
    ancestor's echo fields (tools, the response object), and nothing before a compaction."""
    big_tool = {"type": "web_search", "x": "A" * 100_000}
    await store.put(linked("r1", None, inputs=[msg("m1", "one")], tools=[big_tool]))
    await store.put(linked("r2", "r1", inputs=[msg("m2", "two")], output=[COMPACTION], tools=[big_tool]))
    await store.put(linked("r3", "r2", inputs=[msg("m3", "three")], tools=[big_tool]))
    await store.put(linked("r4", "r3", inputs=[msg("m4", "four")], tools=[big_tool]))
    chain = await store.chain("r4", "t")
    assert [link.id for link in chain.links] == ["r2", "r3", "r4"]  # r1 is before the compaction
    assert [link.compacted for link in chain.links] == [True, False, False]
    assert chain.missing_ancestor is None
    assert not hasattr(chain.links[0], "tools") and chain.last.tools == [big_tool]  # the newest row's only
    assert await store.chain("r4", "other tenant") is None
    # A deleted ancestor before the compaction is not part of the context; one after it is.
    assert await store.delete("r1", "t")
    assert (await store.chain("r4", "t")).missing_ancestor is None
    assert await store.delete("r3", "t")
    assert (await store.chain("r4", "t")).missing_ancestor == "r3"


async def test_rows_stored_before_the_compacted_column_are_backfilled(tmp_path):
    path = str(tmp_path / "v5.db")
    db = old_sqlite(path, 5, "blocked TEXT, engine_replica TEXT")
    old = [linked("r1", None, inputs=[msg("m1", "x")]),
           linked("r2", "r1", output=[COMPACTION, msg("m2", 'they wrote "type": "compaction"')]),
           linked("r3", "r2", output=[msg("m3", '"type": "compaction"')])]
    for rec in old:
        db.execute("INSERT INTO responses VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rec.row()[:13])
    db.commit()
    db.close()
    store = SQLiteStore(path)
    await store.start()
    try:
        chain = await store.chain("r3", "t")
        assert [(link.id, link.compacted) for link in chain.links] == [("r2", True), ("r3", False)]
    finally:
        await store.close()
