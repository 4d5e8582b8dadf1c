"""Conversations in the response store: durable state a response reads and appends to
(`conversation` on `responses.create`), tenant-scoped like responses. The SQL both backends
share; each backend runs it with its own placeholders (`?` or `$n`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class StoredConversation:
    """One conversation: its metadata and where its items stand. `version` counts every change
    to its items; `head_response_id` is the response whose context is exactly the items as they
    stood at `head_version`: while nothing else changed, a turn continues from that response's
    state (cached, with its render and its engine prefix) instead of rendering every item."""

    id: str
    tenant: str
    created_at: float
    metadata: dict[str, str] = field(default_factory=dict)
    version: int = 0
    head_response_id: Optional[str] = None
    head_version: int = -1

    @property
    def head(self) -> Optional[str]:
        """The response a turn may continue from (None: its items changed since, or none ran)."""
        return self.head_response_id if self.head_version == self.version else None

    def row(self) -> tuple:
        return (self.id, self.tenant, self.created_at, json.dumps(self.metadata), self.version,
                self.head_response_id, self.head_version)

    @classmethod
    def from_row(cls, row: Any) -> "StoredConversation":
        r = tuple(row)
        return cls(r[0], r[1], float(r[2]), json.loads(r[3]), int(r[4]), r[5], int(r[6]))


CONVERSATION_COLUMNS = "id, tenant, created_at, metadata, version, head_response_id, head_version"


def conversation_tables(seq_column: str, float_type: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at {float_type} NOT NULL, metadata TEXT NOT NULL,
    version BIGINT NOT NULL DEFAULT 0, head_response_id TEXT, head_version BIGINT NOT NULL DEFAULT -1)""",
        # Item ids are the client's to choose (an earlier output sent back): not unique here; an
        # id names its newest copy.
        f"""CREATE TABLE IF NOT EXISTS conversation_items (
    seq {seq_column}, conversation_id TEXT NOT NULL, tenant TEXT NOT NULL, item_id TEXT NOT NULL,
    item TEXT NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS conversation_items_by_seq ON conversation_items (conversation_id, seq)",
        "CREATE INDEX IF NOT EXISTS conversation_items_by_id ON conversation_items (conversation_id, item_id, seq)",
    ]


def item_rows(conversation_id: str, tenant: str, items: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    return [(conversation_id, tenant, item["id"], json.dumps(item)) for item in items]


class Sql:
    """The statements, with a backend's placeholder style (`p(1)` is the first parameter)."""

    def __init__(self, positional: bool) -> None:
        def p(i: int) -> str:
            return f"${i}" if positional else "?"

        self.insert = (f"INSERT INTO conversations ({CONVERSATION_COLUMNS}) "
                       f"VALUES ({', '.join(p(i) for i in range(1, 8))})")
        self.get = f"SELECT {CONVERSATION_COLUMNS} FROM conversations WHERE id = {p(1)} AND tenant = {p(2)}"
        self.set_metadata = f"UPDATE conversations SET metadata = {p(1)} WHERE id = {p(2)} AND tenant = {p(3)}"
        # Every change to the items moves the version; an append by a response moves the head with it.
        self.bump = (f"UPDATE conversations SET version = version + {p(1)} "
                     f"WHERE id = {p(2)} AND tenant = {p(3)} RETURNING version")
        self.set_head = (f"UPDATE conversations SET head_response_id = {p(1)}, head_version = {p(2)} "
                         f"WHERE id = {p(3)} AND tenant = {p(4)}")
        self.delete = f"DELETE FROM conversations WHERE id = {p(1)} AND tenant = {p(2)}"
        self.delete_items = f"DELETE FROM conversation_items WHERE conversation_id = {p(1)} AND tenant = {p(2)}"
        self.add_item = (f"INSERT INTO conversation_items (conversation_id, tenant, item_id, item) "
                         f"VALUES ({p(1)}, {p(2)}, {p(3)}, {p(4)})")
        self.get_item = (f"SELECT seq, item FROM conversation_items WHERE conversation_id = {p(1)} "
                         f"AND tenant = {p(2)} AND item_id = {p(3)} ORDER BY seq DESC LIMIT 1")
        self.delete_item = f"DELETE FROM conversation_items WHERE seq = {p(1)}"
        page = (f"SELECT seq, item FROM conversation_items WHERE conversation_id = {p(1)} AND tenant = {p(2)} "
                f"AND seq {{op}} {p(3)} ORDER BY seq {{order}} LIMIT {p(4)}")
        self.page_asc = page.format(op=">", order="ASC")
        self.page_desc = page.format(op="<", order="DESC")


# `after_seq` for a first page: before every item (asc), after every item (desc).
FIRST_SEQ, LAST_SEQ = -1, 2 ** 62
