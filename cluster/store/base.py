"""The `ResponseStore` interface and how a stored chain becomes a `ResponseState` again."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from cluster.core.turn.cache import ResponseState
from cluster.core.turn.context import output_as_context


@dataclass
class StoredResponse:
    """One response as stored: its own input and output, linked to its parent."""

    id: str
    tenant: str
    previous_response_id: Optional[str]
    created_at: float
    model: str
    input_items: list[dict[str, Any]]  # this response's new input, with ids
    output: list[dict[str, Any]]
    response: dict[str, Any]  # the Response object as last sent
    instructions: Optional[str]
    tools: list[dict[str, Any]]
    affinity_key: Optional[str] = None
    # Why this response may not be continued (a late output-safety flag, a failed
    # background run): kept durable so a restart does not lift it.
    blocked: Optional[dict[str, Any]] = None
    # The engine replica that holds the chain's prefix KV (its placement): a turn continuing
    # from the store on any connection replica goes back there.
    engine_replica: Optional[str] = None

    @property
    def compacted(self) -> bool:
        """It compacted its context in the turn: its input is the whole window it continued from,
        so no ancestor of it is part of its chain's context."""
        return any(o.get("type") == "compaction" for o in self.output)

    def row(self) -> tuple:
        return (
            self.id, self.tenant, self.previous_response_id, self.created_at, self.model,
            json.dumps(self.input_items), json.dumps(self.output), json.dumps(self.response),
            self.instructions, json.dumps(self.tools), self.affinity_key,
            json.dumps(self.blocked) if self.blocked is not None else None, self.engine_replica,
            int(self.compacted),
        )

    def item_rows(self) -> list[tuple[str, str, str, str]]:
        """(tenant, item id, response id, item JSON) of every item with an id, input and output:
        what `item_reference` inputs resolve from."""
        return [(self.tenant, item["id"], self.id, json.dumps(item))
                for item in (*self.input_items, *self.output) if isinstance(item.get("id"), str)]

    @classmethod
    def from_row(cls, row: Any) -> "StoredResponse":
        r = tuple(row)
        return cls(r[0], r[1], r[2], float(r[3]), r[4], json.loads(r[5]), json.loads(r[6]), json.loads(r[7]),
                   r[8], json.loads(r[9]), r[10], json.loads(r[11]) if r[11] else None, r[12])  # r[13]: derived


COLUMNS = ("id, tenant, previous_response_id, created_at, model, input_items, output, response, "
           "instructions, tools, affinity_key, blocked, engine_replica, compacted")
COLUMN_COUNT = len(COLUMNS.split(","))
# Rows stored before `compacted` was a column: the server's own JSON of a compaction item (a
# client's text holding these characters is escaped inside a JSON string, so it cannot match).
BACKFILL_COMPACTED = """UPDATE responses SET compacted = 1 WHERE output LIKE '%"type": "compaction"%'"""


@dataclass
class ChainLink:
    """What a continuation needs of an ancestor: its own input and output. Its echo fields (the
    request's tools, the response object) are never loaded: they are the newest row's alone."""

    id: str
    previous_response_id: Optional[str]
    input_items: list[dict[str, Any]]
    output: list[dict[str, Any]]
    compacted: bool


@dataclass
class StoredChain:
    """A stored response's context as the store holds it: its links oldest first, from the
    nearest compaction (nothing before it is part of the context), and the response itself."""

    links: list[ChainLink]
    last: StoredResponse

    @property
    def missing_ancestor(self) -> Optional[str]:
        """The id of a deleted ancestor the context needs (None: the chain is whole)."""
        first = self.links[0]
        return first.previous_response_id if not first.compacted else None

# Items by id, per tenant (`item_reference` inputs); deleted with their response. A row per
# (response, item): item ids in an input are the client's to choose, so two responses may carry
# the same id (a client sending back an earlier output is the common case). A reference resolves
# to the newest response's copy still stored, and deleting one response never touches another's.
ITEMS_TABLE_NAME = "stored_items"
LEGACY_ITEMS_TABLE = "response_items"  # schema version 3: (tenant, item id) was the key


def items_table(seq_column: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS {ITEMS_TABLE_NAME} (
    seq {seq_column}, tenant TEXT NOT NULL, item_id TEXT NOT NULL, response_id TEXT NOT NULL,
    item TEXT NOT NULL, UNIQUE (tenant, response_id, item_id))""",
        f"CREATE INDEX IF NOT EXISTS stored_items_by_id ON {ITEMS_TABLE_NAME} (tenant, item_id, seq)",
    ]


# Copies a version-3 table's rows (at most one per id there) and drops it.
MIGRATE_LEGACY_ITEMS = [
    f"INSERT INTO {ITEMS_TABLE_NAME} (tenant, item_id, response_id, item) "
    f"SELECT tenant, item_id, response_id, item FROM {LEGACY_ITEMS_TABLE}",
    f"DROP TABLE {LEGACY_ITEMS_TABLE}",
]


def chain_query(id_param: str, tenant_param: str) -> str:
    """A response's links and its ancestors' (same tenant at every hop), oldest first, in one
    query: the walk reads ids only and stops at the nearest compaction; then only the input and
    output of the rows it reached are read (the echo fields of the last row come from `get`)."""
    return f"""
WITH RECURSIVE chain(depth, id, tenant, previous_response_id, compacted) AS (
    SELECT 0, id, tenant, previous_response_id, compacted FROM responses
    WHERE id = {id_param} AND tenant = {tenant_param}
    UNION ALL
    SELECT chain.depth + 1, r.id, r.tenant, r.previous_response_id, r.compacted
    FROM responses r JOIN chain ON r.id = chain.previous_response_id AND r.tenant = chain.tenant
    WHERE chain.compacted = 0
)
SELECT r.id, r.previous_response_id, r.input_items, r.output, r.compacted
FROM chain JOIN responses r ON r.id = chain.id AND r.tenant = chain.tenant ORDER BY chain.depth DESC
"""


def link_from_row(row: Any) -> ChainLink:
    r = tuple(row)
    return ChainLink(r[0], r[1], json.loads(r[2]), json.loads(r[3]), bool(r[4]))


class ResponseStore(Protocol):
    """Responses owned by tenants; every read names the tenant (others see nothing)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str, tenant: str) -> Optional[StoredResponse]: ...

    async def chain(self, response_id: str, tenant: str) -> Optional[StoredChain]:
        """The response and its context's links, oldest first (None if not found for this tenant)."""
        ...

    async def delete(self, response_id: str, tenant: str) -> bool: ...

    async def get_item(self, item_id: str, tenant: str) -> Optional[dict[str, Any]]: ...

    async def mark_blocked(self, response_id: str, tenant: str, blocked: dict[str, Any]) -> bool:
        """Record that a stored response may not be continued (False if it is not stored yet)."""
        ...


def state_from_chain(chain: StoredChain) -> ResponseState:
    """Rebuild the continuation state of `chain.last` (a cache miss: rendering starts over)."""
    items: list[dict[str, Any]] = []
    last_output: list[dict[str, Any]] = []
    for rec in chain.links:
        if rec.compacted:
            # It compacted its context in the turn: its input is the whole window it continued from.
            items = []
        items.extend(rec.input_items)
        last_output = output_as_context(rec.output)
        items.extend(last_output)
    last = chain.last
    return state_from_items(items, response_id=last.id, model=last.model, owner=last.tenant,
                            output_start=len(items) - len(last_output), instructions=last.instructions,
                            tools=last.tools, affinity_key=last.affinity_key,
                            engine_replica=last.engine_replica or "", response=last.response, blocked=last.blocked)


def state_from_items(items: list[dict[str, Any]], *, response_id: str, model: str, owner: str,
                     output_start: Optional[int] = None, **fields: Any) -> ResponseState:
    """A context as a continuation state with nothing rendered (a stored chain, or a
    conversation's items): its function calls and those still waiting for their output."""
    known: set[str] = set()
    pending: list[str] = []
    for item in items:
        if item.get("type") == "function_call":
            known.add(item["call_id"])
            pending.append(item["call_id"])
        elif item.get("type") == "function_call_output" and item.get("call_id") in pending:
            pending.remove(item["call_id"])
    return ResponseState(response_id=response_id, model=model, items=items,
                         output_start=len(items) if output_start is None else output_start,
                         instructions=fields.pop("instructions", None), tools=fields.pop("tools", []),
                         rendered=None, known_call_ids=frozenset(known), pending_call_ids=tuple(pending),
                         store=True, owner=owner, **fields)
