"""The Conversations endpoint family (`/v1/conversations` and its items) and the conversation
port of a turn (`conversation` on `responses.create`, cluster/core/turn/conversation.py), over
the response store. Tenant-scoped like responses: another key's conversation does not exist.

Plain Python with an injected store, used by the ConnectionActor's routes and its turns."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from cluster.core.turn.cache import ResponseState, SessionCache
from cluster.core.turn.context import without_private
from cluster.core.turn.conversation import Lookup
from cluster.protocol import conversations as wire
from cluster.protocol.errors import ApiError
from cluster.protocol.ids import new_id
from cluster.serving.items import ID_PREFIX, input_with_ids, listed_item
from cluster.store.base import state_from_items
from cluster.store.conversations import StoredConversation

log = logging.getLogger(__name__)


def no_store() -> ApiError:
    return ApiError(400, "This server keeps no conversations: it runs without a response store.",
                    param="conversation", code="conversations_unavailable")


def unavailable() -> ApiError:
    return ApiError(503, "The conversation store is unavailable right now; retry the request.",
                    code="store_unavailable", type="server_error")


class ConversationsService:
    def __init__(self, store: Any, *, model: str, max_items: int) -> None:
        self.store = store  # a ResponseStore with the conversation methods (cluster/store/*.py), or None
        self.model = model
        self.max_items = max_items  # what one turn may read from a conversation: a request's input bound

    async def _call(self, call):
        """A store call; the store being down is a retryable 503, not a stack trace."""
        try:
            return await call
        except ApiError:
            raise
        except Exception as exc:
            log.warning("conversation store call failed: %s", type(exc).__name__)
            raise unavailable() from None

    async def _get(self, conversation_id: str, tenant: str) -> StoredConversation:
        if self.store is None:
            raise no_store()
        found = await self._call(self.store.get_conversation(conversation_id, tenant))
        if found is None:
            raise wire.conversation_not_found(conversation_id)
        return found

    # -- endpoints -----------------------------------------------------------------
    async def create(self, body: Any, tenant: str) -> dict[str, Any]:
        items, metadata = wire.create_body(body)
        if self.store is None:
            raise no_store()
        conversation = StoredConversation(new_id("conv"), tenant, time.time(), metadata, version=len(items))
        await self._call(self.store.put_conversation(conversation, [_with_id(i) for i in items]))
        return wire.conversation_object(conversation.id, conversation.created_at, metadata)

    async def retrieve(self, conversation_id: str, tenant: str) -> dict[str, Any]:
        c = await self._get(conversation_id, tenant)
        return wire.conversation_object(c.id, c.created_at, c.metadata)

    async def update(self, conversation_id: str, body: Any, tenant: str) -> dict[str, Any]:
        metadata = wire.update_body(body)
        c = await self._get(conversation_id, tenant)
        if not await self._call(self.store.set_conversation_metadata(conversation_id, tenant, metadata)):
            raise wire.conversation_not_found(conversation_id)
        return wire.conversation_object(c.id, c.created_at, metadata)

    async def delete(self, conversation_id: str, tenant: str) -> dict[str, Any]:
        if self.store is None:
            raise no_store()
        if not await self._call(self.store.delete_conversation(conversation_id, tenant)):
            raise wire.conversation_not_found(conversation_id)
        return wire.deleted_object(conversation_id)

    async def add_items(self, conversation_id: str, body: Any, tenant: str) -> dict[str, Any]:
        items = [_with_id(i) for i in wire.items_create_body(body)]
        await self._get(conversation_id, tenant)
        if not await self._call(self.store.append_conversation_items(conversation_id, tenant, items)):
            raise wire.conversation_not_found(conversation_id)
        return wire.item_list([without_private(i) for i in items], has_more=False)

    async def list_items(self, conversation_id: str, tenant: str, *, after: Optional[str], limit: int,
                         order: str) -> dict[str, Any]:
        wire.page_query(limit, order)
        await self._get(conversation_id, tenant)
        after_seq = None
        if after is not None:
            found = await self._call(self.store.conversation_item(conversation_id, tenant, after))
            if found is None:
                raise ApiError(400, f"No item with id '{after[:256]}' in this conversation.", param="after",
                               code="invalid_value")
            after_seq = found[0]
        rows = await self._call(self.store.conversation_items(conversation_id, tenant, after_seq=after_seq,
                                                              limit=limit + 1, order=order))
        return wire.item_list([without_private(item) for _, item in rows[:limit]], has_more=len(rows) > limit)

    async def get_item(self, conversation_id: str, item_id: str, tenant: str) -> dict[str, Any]:
        await self._get(conversation_id, tenant)
        found = await self._call(self.store.conversation_item(conversation_id, tenant, item_id))
        if found is None:
            raise wire.item_not_found(item_id)
        return without_private(found[1])

    async def delete_item(self, conversation_id: str, item_id: str, tenant: str) -> dict[str, Any]:
        c = await self._get(conversation_id, tenant)
        if not await self._call(self.store.delete_conversation_item(conversation_id, tenant, item_id)):
            raise wire.item_not_found(item_id)
        return wire.conversation_object(c.id, c.created_at, c.metadata)  # what OpenAI answers

    # -- the turn's port (cluster/core/turn/conversation.py) ---------------------------
    async def parent(self, conversation_id: str, owner: str, cache: SessionCache,
                     lookup: Optional[Lookup]) -> ResponseState:
        c = await self._get(conversation_id, owner)
        head = c.head
        if head is not None:
            state = cache.get(head)
            if state is None and lookup is not None:
                try:
                    state = await lookup(head)
                except ApiError:
                    state = None  # its chain is gone from the store: the items are the context
            if state is not None and state.owner == owner and not state.blocked:
                return state
        rows = await self._call(self.store.conversation_items(conversation_id, owner, limit=self.max_items + 1))
        if len(rows) > self.max_items:
            raise ApiError(400, f"Conversation '{conversation_id[:256]}' holds more than {self.max_items} items, "
                                "more than one response may read.", param="conversation", code="conversation_too_long")
        # As stored: server-side keys (an opened compaction's summary) are part of the context.
        return state_from_items([item for _, item in rows], response_id=conversation_id, model=self.model,
                                owner=owner)

    async def append(self, conversation_id: str, owner: str, state: ResponseState, response: dict[str, Any]) -> None:
        if self.store is None:
            raise no_store()
        items = [listed_item(i, server_side=True) for i in input_with_ids(state)]
        inputs = {i["id"] for i in items}  # what a response outputs before generating is its input too (MCP)
        items += [listed_item(i, server_side=True) for i in response.get("output") or [] if i.get("id") not in inputs]
        ok = await self._call(self.store.append_conversation_items(conversation_id, owner, items,
                                                                   head_response_id=state.response_id))
        if not ok:  # deleted while the turn ran
            raise wire.conversation_not_found(conversation_id)
        if state.blocked:  # its output's tail was flagged while this write was on its way
            await self.forget_output(conversation_id, owner, response.get("output") or [])

    async def forget_output(self, conversation_id: str, owner: str, output: list[dict[str, Any]]) -> None:
        """A response flagged after its terminal event (output safety on its tail): its output
        leaves the conversation, so no later turn reads it (a conversation has no parent to block)."""
        for item in output:
            if isinstance(item.get("id"), str):
                await self._call(self.store.delete_conversation_item(conversation_id, owner, item["id"]))


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An item as the conversation keeps it: typed, with an id and a status (as the API lists it)."""
    out = listed_item(item, server_side=True)
    if not out.get("id"):
        out["id"] = new_id(ID_PREFIX.get(out["type"], "item"))
    return out
