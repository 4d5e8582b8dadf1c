"""The Responses endpoint family beyond create: retrieve, delete, cancel, input items,
input token counts, compaction, background responses, and the durable store.

Plain Python with injected ports (driver, caches, store), used by the
ConnectionActor's routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from cluster.core.events import build_response, usage_object
from cluster.core.replay import replay_events
from cluster.core.turn.cache import ResponseState, SessionCache
from cluster.core.turn.compaction import (
    compacted_window,
    kept_messages,
    needs_summary,
    summarise,
)
from cluster.core.turn.context import without_private
from cluster.core.turn.driver import TurnDriver
from cluster.core.turn.post_work import TurnRecord
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.errors import ApiError, previous_response_not_found
from cluster.protocol.ids import new_id
from cluster.protocol.requests import parse_request
from cluster.serving.items import input_with_ids, listed_item
from cluster.store import ResponseStore, StoredResponse, state_from_chain

if TYPE_CHECKING:  # pragma: no cover
    from cluster.serving.conversations import ConversationsService

log = logging.getLogger(__name__)


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", code="not_found", param="response_id")



@dataclass
class BackgroundJob:
    """A background response while it runs: its owner, its latest snapshot (what a GET returns)
    and the task running it (cancelled by `cancel`)."""

    tenant: str
    response: dict[str, Any]
    task: Optional[asyncio.Task] = None


class ResponsesService:
    def __init__(self, driver: TurnDriver, registry: SessionCache, store: Optional[ResponseStore],
                 max_background: int = 256, max_background_per_tenant: int = 64) -> None:
        self.driver = driver
        self.max_background = max_background
        self.max_background_per_tenant = max_background_per_tenant
        self.registry = registry  # replica-wide: store:true states, tenant-checked on every read
        self.store = store
        self.background: dict[str, BackgroundJob] = {}  # response id -> its job, while it runs
        self.conversations: Optional["ConversationsService"] = None  # its turns' conversations (set by the replica)

    # -- lookups -----------------------------------------------------------------
    async def lookup(self, response_id: str, tenant: str) -> Optional[ResponseState]:
        state = self.registry.get(response_id)
        if state is not None:
            return state if state.owner == tenant else None  # an owner-less state is no one's
        if self.store is None:
            return None
        chain = await self._read(self.store.chain(response_id, tenant))
        if chain is None:
            return None
        if chain.missing_ancestor is not None:
            # An ancestor was deleted: continuing would silently drop its part of the context.
            raise ApiError(400, f"Response '{response_id}' cannot be continued: its ancestor "
                                f"'{chain.missing_ancestor}' was deleted, so its context is incomplete.",
                           param="previous_response_id", code="previous_response_chain_broken")
        state = state_from_chain(chain)
        self.registry.put(state)
        return state

    def lookup_for(self, tenant: str):
        async def lookup(response_id: str) -> Optional[ResponseState]:
            return await self.lookup(response_id, tenant)

        return lookup

    def remember(self, state: ResponseState) -> None:
        if state.store:
            self.registry.put(state)

    # -- persistence (post-inference work) ------------------------------------------
    async def persist(self, record: TurnRecord) -> None:
        state: Optional[ResponseState] = record.state
        if self.store is None or not record.store or state is None or record.response is None:
            return
        if state.owner is None:  # no tenant, no row: a missing owner never becomes "default"
            log.error("response %s has no owner; not stored", state.response_id)
            return
        t0 = time.perf_counter()
        # A failure raises: the post-work queue retries it (`store.write_retry_s`).
        stored = self._stored(state, record.response)
        await self.store.put(stored)
        if state.blocked is not None and stored.blocked is None:
            # Flagged while this write was on its way: the flag must not be lost.
            await self.store.mark_blocked(state.response_id, stored.tenant, state.blocked)
        self.driver.metrics.store_written(time.perf_counter() - t0, type(self.store).__name__)

    def _stored(self, state: ResponseState, response: dict[str, Any]) -> StoredResponse:
        # an opened compaction keeps its summary
        inputs = [listed_item(item, server_side=True) for item in input_with_ids(state)]
        return StoredResponse(
            id=state.response_id, tenant=state.owner,
            previous_response_id=response.get("previous_response_id"), created_at=float(response["created_at"]),
            model=state.model, input_items=inputs, output=response.get("output") or [], response=response,
            instructions=state.instructions, tools=state.tools, affinity_key=state.affinity_key,
            blocked=state.blocked, engine_replica=state.engine_replica or None,
        )

    async def mark_blocked(self, record: TurnRecord) -> None:
        """A stored response flagged after its terminal event: make the flag durable. A response
        on a conversation leaves it: its output items are taken out of the conversation."""
        state: Optional[ResponseState] = record.state
        conversation = (record.response or {}).get("conversation")
        if conversation and self.conversations is not None and state is not None and state.owner is not None:
            await self.conversations.forget_output(conversation["id"], state.owner, record.response["output"])
        if self.store is None or state is None or not state.store or state.blocked is None or state.owner is None:
            return
        await self.store.mark_blocked(state.response_id, state.owner, state.blocked)

    # -- endpoints -----------------------------------------------------------------
    async def retrieve(self, response_id: str, tenant: str) -> dict[str, Any]:
        job = self.background.get(response_id)
        if job is not None and job.tenant == tenant:
            return job.response
        state = await self.lookup(response_id, tenant)
        if state is None or state.response is None:
            raise not_found(response_id)
        return withheld(state.response, state.blocked)

    async def replay(self, response_id: str, tenant: str, starting_after: Optional[int]) -> list[dict[str, Any]]:
        events = replay_events(await self.retrieve(response_id, tenant))
        if starting_after is not None:
            events = [e for e in events if e["sequence_number"] > starting_after]
        return events

    async def _read(self, call):
        """A store read; the store being down is a retryable 503, not a stack trace."""
        try:
            return await call
        except Exception as exc:
            log.warning("store read failed: %s", type(exc).__name__)
            raise ApiError(503, "The response store is unavailable right now; retry the request.",
                           code="store_unavailable", type="server_error") from None

    async def delete(self, response_id: str, tenant: str) -> dict[str, Any]:
        state = self.registry.get(response_id)
        found = state is not None and state.owner == tenant
        own_ids: set[str] = set()
        if found:
            own_ids = {i["id"] for i in state.items[state.input_start:] if isinstance(i.get("id"), str)}
            self.registry.evict(response_id)
        if self.store is not None:
            record = await self._read(self.store.get(response_id, tenant))
            if record is not None:
                own_ids |= {i["id"] for i in [*record.input_items, *record.output] if isinstance(i.get("id"), str)}
            found = await self._read(self.store.delete(response_id, tenant)) or found
        if not found:
            raise not_found(response_id)
        self._forget_descendants(tenant, own_ids)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _forget_descendants(self, tenant: str, item_ids: set[str]) -> None:
        """Responses that continue a deleted one hold its items in memory: drop them, so their
        continuation goes to the store and fails as a broken chain (never uses deleted data)."""
        if not item_ids:
            return
        for rid in list(self.registry):
            state = self.registry.peek(rid)
            if state is not None and state.owner == tenant and any(
                    i.get("id") in item_ids for i in state.items):
                self.registry.evict(rid)

    async def input_items(self, response_id: str, tenant: str, *, after: Optional[str], limit: int,
                          order: str) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be 'asc' or 'desc'.", param="order", code="invalid_value")
        state = await self.lookup(response_id, tenant)
        if state is None:
            raise not_found(response_id)
        # Only the page is listed (listing all 10,000 items for a `limit=1` page cost
        # ~20-45 ms a read, charged as the page); finding `after` is a scan of ids.
        items = input_with_ids(state)
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise ApiError(400, f"No item with id '{after}' in this response's input.", param="after",
                               code="invalid_value")
            items = items[ids.index(after) + 1 :]
        page = [without_private(listed_item(i, server_side=True)) for i in items[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def _parent(self, req, tenant: str) -> Optional[ResponseState]:
        if not req.previous_response_id:
            return None
        parent = await self.lookup(req.previous_response_id, tenant)
        if parent is None:
            raise previous_response_not_found(req.previous_response_id)
        return parent

    async def input_tokens(self, body: Any, tenant: str) -> dict[str, Any]:
        req = parse_request(body, max_input_items=self.driver.settings.max_input_items)
        self.driver.check_model(req)
        count = await self.driver.count_input_tokens(req, await self._parent(req, tenant), tenant)
        return {"object": "response.input_tokens", "input_tokens": count}

    async def compact(self, body: Any, tenant: str) -> dict[str, Any]:
        """`POST /v1/responses/compact`: the context window (the parent's items, then `input`) as
        its user messages verbatim plus one sealed `compaction` item whose summary the served model
        writes (cluster/core/turn/compaction.py); only user messages: returned as they are."""
        if not isinstance(body, dict) or not body.get("model"):
            raise ApiError(400, "Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
        req = parse_request(body, max_input_items=self.driver.settings.max_input_items)
        self.driver.check_model(req)
        parent = await self._parent(req, tenant)
        items = (list(parent.items) if parent else []) + await self.driver.preparer.input_items(req, parent, tenant)
        usage = usage_object(0, 0, 0)
        output = [listed_item(item) for item in kept_messages(items)]
        if needs_summary(items):
            summary, usage = await summarise(self.driver.run, self.driver.settings, items, tenant)
            output.append(compacted_window(items, summary, self.driver.sealer, tenant)[1])
        return {"id": new_id("cmp"), "object": "response.compaction", "created_at": int(time.time()),
                "output": output, "usage": usage}

    # -- background ----------------------------------------------------------------
    def start_background(self, req, tenant: str, session_key: str) -> dict[str, Any]:
        if req.store is False:
            raise ApiError(400, "background responses require store: true.", param="background", code="invalid_value")
        if len(self.background) >= self.max_background:
            raise ApiError(429, f"Too many background responses in progress (limit {self.max_background}); "
                                "retry when some have finished.", code="rate_limit_exceeded")
        if sum(1 for job in self.background.values() if job.tenant == tenant) >= self.max_background_per_tenant:
            raise ApiError(429, f"Too many background responses of yours in progress (limit "
                                f"{self.max_background_per_tenant}); retry when some have finished.",
                           code="rate_limit_exceeded")
        rid = new_id("resp")
        response = build_response(response_id=rid, model=self.driver.model_name, request=req,
                                  previous_response_id=req.previous_response_id,
                                  sampling=self.driver.settings.sampling_defaults)
        response["status"] = "queued"
        job = BackgroundJob(tenant, response)
        job.task = asyncio.get_running_loop().create_task(self._run_background(req, tenant, session_key, rid, job))
        self.background[rid] = job
        return response

    async def _run_background(self, req, tenant: str, session_key: str, rid: str, job: BackgroundJob) -> None:
        committed = False

        def remember(state: ResponseState) -> None:
            nonlocal committed
            committed = True
            self.remember(state)

        try:
            scope = TurnScope(SessionCache(1), session_key=session_key, owner=tenant, lookup=self.lookup_for(tenant),
                              on_state=remember, conversations=self.conversations)
            async for ev in self.driver.run(TurnRequest(req, scope, response_id=rid)):
                if "response" in ev:
                    job.response = ev["response"]
        except ApiError as err:
            job.response = {**job.response, "status": "failed", "completed_at": int(time.time()),
                            "error": {"code": err.code or err.type, "message": err.message}}
        except asyncio.CancelledError:
            raise  # `cancel` commits the cancelled response itself
        except Exception:
            log.exception("background response %s failed", rid)
            job.response = {**job.response, "status": "failed", "completed_at": int(time.time()),
                            "error": {"code": "server_error", "message": "The server had an error."}}
        finally:
            response = job.response
            if response["status"] in TERMINAL_STATUSES:
                if not committed:
                    # Failed or content-filtered: no continuation state, but the
                    # client polling GET must see how it ended (not a 404).
                    await self._commit_final(rid, tenant, response)
                self.background.pop(rid, None)

    async def _commit_final(self, rid: str, tenant: str, response: dict[str, Any]) -> None:
        """A response that ended without a continuable state: retrievable, never continuable."""
        state = ResponseState(response_id=rid, model=self.driver.model_name, items=[], output_start=0,
                              instructions=response.get("instructions"), tools=response.get("tools") or [],
                              rendered=None, known_call_ids=frozenset(), pending_call_ids=(), store=True,
                              owner=tenant, response=response,
                              blocked={"status": response["status"]})
        self.registry.put(state)
        if self.store is not None:
            try:
                await self.store.put(self._stored(state, response))
            except Exception:
                log.warning("store write of background response %s failed; kept in memory", rid)

    async def cancel(self, response_id: str, tenant: str) -> dict[str, Any]:
        job = self.background.get(response_id)
        if job is None or job.tenant != tenant:
            state = await self.lookup(response_id, tenant)
            if state is None:
                raise not_found(response_id)
            if state.response and state.response.get("background"):
                return state.response  # already finished: cancelling is a no-op
            raise ApiError(400, "Only background responses can be cancelled.", param="response_id",
                           code="invalid_value")
        if job.task is not None:
            job.task.cancel()
            try:
                await job.task
            except (asyncio.CancelledError, Exception):
                pass
        response = {**job.response, "status": "cancelled", "completed_at": int(time.time())}
        self.background.pop(response_id, None)
        await self._commit_final(response_id, tenant, response)
        return response


TERMINAL_STATUSES = ("completed", "incomplete", "failed", "cancelled")


def withheld(response: dict[str, Any], blocked: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A response as it is read back: one whose output was flagged after its terminal event (its
    tail's check is post-inference work on a streamed answer) keeps no output, as a response cut by
    the content filter while it streamed does."""
    if not (blocked and blocked.get("flagged")):
        return response
    return {**response, "status": "incomplete", "incomplete_details": {"reason": "content_filter"}, "output": []}
