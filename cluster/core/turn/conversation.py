"""A turn on a conversation (`conversation` on the request): its context is the conversation's
items, and its own input and output are appended to them before its terminal event leaves.

The port the driver calls (`TurnScope.conversations`); the serving layer implements it over the
store (cluster/serving/conversations.py). A conversation whose items are exactly the context
of the response that last appended to it continues from that response's state, as a chained
turn does: the connection's cache, its render and its engine prefix are reused."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional, Protocol

from cluster.core.turn.cache import ResponseState, SessionCache

# A parent response not in the connection's cache: the store, or the replica's registry.
Lookup = Callable[[str], Awaitable[Optional[ResponseState]]]


class ConversationPort(Protocol):
    async def parent(self, conversation_id: str, owner: str, cache: SessionCache,
                     lookup: Optional[Lookup]) -> ResponseState:
        """The context to continue from. Raises `ApiError` 404 for a conversation this owner
        does not have, 400 for one too long to be a turn's input."""
        ...

    async def append(self, conversation_id: str, owner: str, state: ResponseState, response: dict[str, Any]) -> None:
        """The turn's input and output, added to the conversation (durably, before the terminal
        event: the next turn may come on another replica). Raises `ApiError` if it could not."""
        ...
