"""Durable store for `store: true` responses: SQLite (one machine) or PostgreSQL."""

from cluster.store.base import ResponseStore, StoredResponse, state_from_chain
from cluster.store.factory import open_store

__all__ = ["ResponseStore", "StoredResponse", "open_store", "state_from_chain"]
