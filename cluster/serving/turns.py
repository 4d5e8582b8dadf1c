"""Where a turn enters, for both transports: the HTTP create (admit, run, and fold the events
into one response or hand the stream back) and a WebSocket's session, wired from the replica's
services and torn down with what it held.

No web framework here: the routes (actors/routes.py) pass in the request's headers, its parsed
body and the socket's send/close, and turn the results into HTTP responses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Mapping, Optional, Union
from urllib.parse import urlsplit

from cluster import telemetry
from cluster.auth import Authenticator, Principal
from cluster.config import LoopserveConfig
from cluster.core.events import Event
from cluster.core.messages import TurnProgress
from cluster.core.turn.cache import CacheMemory, SessionCache
from cluster.core.turn.conversation import ConversationPort
from cluster.core.turn.driver import TurnDriver
from cluster.core.turn.turn import TurnRequest, TurnScope, cache_salt
from cluster.core.websocket.inflight import ReplicaHeld
from cluster.core.websocket.session import ReplicaShared, TenantGate, WebSocketSession
from cluster.protocol import ids
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.request_bounds import ReplicaQueue
from cluster.protocol.requests import admit_create, session_header
from cluster.serving.clients import EngineClient
from cluster.serving.responses import ResponsesService

SendEvent = Callable[[Event], Awaitable[None]]
CloseSocket = Callable[[int, str], Awaitable[None]]


@dataclass
class StreamedTurn:
    """A streamed HTTP turn: its first event (the turn has started: errors before it were raised
    as `ApiError`) and the rest. Closing `rest` early cancels the engine call."""

    first: Event
    rest: AsyncIterator[Event]


@dataclass(eq=False)
class Socket:
    """One open WebSocket: its session and whose it is."""

    session: WebSocketSession
    principal: Principal


class TurnsService:
    def __init__(self, config: LoopserveConfig, *, driver: TurnDriver, responses: ResponsesService,
                 auth: Authenticator, memory: CacheMemory, engine: EngineClient, metrics: telemetry.Metrics,
                 settle: Callable[[list[str]], Awaitable[bool]], conversations: Optional[ConversationPort] = None) -> None:
        self.config = config
        self.conversations = conversations
        self.driver, self.responses, self.auth, self.memory = driver, responses, auth, memory
        self.engine, self.metrics = engine, metrics
        self.sockets: set[Socket] = set()
        self.draining = False
        self.shared = ReplicaShared(
            queue=ReplicaQueue(config.websocket.max_replica_queued_bytes),
            # Every socket's steering input and injected outputs (they were once bounded per socket only).
            held=ReplicaHeld(config.websocket.max_replica_held_bytes,
                             sample=lambda: sum(s.session.protocol.held_bytes() for s in self.sockets)),
            heavy=TenantGate(),
            settle=settle,
        )

    # -- HTTP ------------------------------------------------------------------------
    async def create(self, body: object, principal: Principal, headers: Mapping[str, str],
                     received_at: float) -> Union[dict, StreamedTurn]:
        """POST /v1/responses: the final response (or a background one, queued), or the stream.
        Raises `ApiError` for a request refused before the turn started, or a turn that failed."""
        limits = self.config.limits
        # The key's rate limit was applied before the body was read (routes.py).
        req = admit_create(body, transport="http", admit=None, max_input_items=limits.max_input_items,
                           depth_checked=True,  # json_body bounded its nesting before parsing it
                           floor=self.driver.preparer.check_body_floor)
        parsed_at = time.perf_counter()
        session_key = ids.session_key(session_header(headers) or req.prompt_cache_key or req.previous_response_id
                                      or req.conversation_id, principal.tenant)
        if req.background:
            return self.responses.start_background(req, principal.tenant, session_key)
        events = self.driver.run(TurnRequest(
            req,
            TurnScope(
                SessionCache(1),  # HTTP has no connection: state goes to the registry
                session_key=session_key,
                owner=principal.tenant,
                lookup=self.responses.lookup_for(principal.tenant),
                on_state=self.responses.remember,
                trace_parent=telemetry.extract_headers(headers),
                conversations=self.conversations,
            ),
            received_at=received_at,
            parsed_at=parsed_at,
        ))
        first = await events.__anext__()  # an ApiError here: refused before anything was sent
        if req.stream:
            return StreamedTurn(first, events)
        progress = TurnProgress()
        progress.observe(first)
        async for ev in events:
            progress.observe(ev)
        if progress.final is None:
            raise server_error()
        error = progress.error
        if progress.status == "failed" and error is not None:
            e = error["error"]
            raise ApiError(error.get("status", 500), e["message"], code=e.get("code"), param=e.get("param"),
                           retry_after_s=error.get("retry_after"))
        return progress.final

    # -- WebSocket -------------------------------------------------------------------
    def check_origin(self, origin: Optional[str]) -> None:
        """A browser page's Origin: one of `allowed_origins` when they are set. Without them, a server
        that takes no API keys admits only pages served from this machine (localhost): any web page
        its user visits could otherwise drive it (a browser adds no key, and needs none here).
        Requests without an Origin (SDKs, CLIs, curl) are not affected."""
        if origin is None:
            return
        allowed = self.config.websocket.allowed_origins
        if allowed:
            ok = origin in allowed
        else:
            ok = self.auth.enabled or _local_origin(origin)
        if not ok:
            hint = "" if allowed or self.auth.enabled else (
                " This server takes no API keys, so only pages served from localhost may use it; list others in "
                "websocket.allowed_origins.")
            raise ApiError(403, f"Origin '{origin[:200]}' is not allowed.{hint}", code="origin_not_allowed",
                           type="invalid_request_error")

    def admit_socket(self, headers: Mapping[str, str]) -> Principal:
        """Before the upgrade: a replica shutting down, a foreign Origin, a bad `x-session-id`, a bad
        key or one over its connection limit are refused with a plain HTTP error. Counts the
        connection against the key (`close_socket` gives it back)."""
        if self.draining:
            raise ApiError(503, "This server is shutting down; connect again.", code="server_draining",
                           type="server_error")
        self.check_origin(headers.get("origin"))
        session_header(headers)  # a bad x-session-id is refused before the upgrade too
        principal = self.auth.authenticate(headers.get("authorization"))
        self.auth.open_connection(principal)
        return principal

    def abandon_socket(self, principal: Principal) -> None:
        """The client left during the upgrade (admitted, never opened): its connection no longer counts."""
        self.auth.close_connection(principal)

    async def open_socket(self, principal: Principal, headers: Mapping[str, str], send: SendEvent,
                          close: CloseSocket) -> Socket:
        """An accepted socket's session (`headers` as `admit_socket` passed them), started and counted;
        drained at once on a draining replica."""
        scope = TurnScope(
            self.memory.socket_cache(),
            session_key=ids.session_key(session_header(headers), principal.tenant),
            transport="websocket",
            owner=principal.tenant,
            lookup=self.responses.lookup_for(principal.tenant),
            on_state=self.responses.remember,
            trace_parent=telemetry.extract_headers(headers),
            conversations=self.conversations,
            include_timing=headers.get("x-responsesapi-include-timing-metrics", "").lower() in ("1", "true"),
        )
        session = WebSocketSession(
            self.driver,
            scope,
            config=self.config.websocket,
            send=send,
            close=close,
            admit=lambda nbytes: self.auth.admit_request(principal, nbytes),
            charge=lambda nbytes: self.auth.admit_bytes(principal, nbytes),
            betas=frozenset(b.strip() for b in headers.get("openai-beta", "").split(",") if b.strip()),
            shared=self.shared,
        )
        socket = Socket(session, principal)
        self.metrics.socket_opened()
        session.start()
        self.sockets.add(socket)
        if self.draining:
            await session.drain()
        return socket

    async def close_socket(self, socket: Socket) -> None:
        """The socket is gone: its lanes are cancelled and cleaned up, its connection uncounted, and
        its engine KV released unless a stored response may still be continued from it."""
        self.metrics.socket_closed()
        self.sockets.discard(socket)
        self.auth.close_connection(socket.principal)
        await socket.session.shutdown()
        # All `store: false` turns of its own: nothing can continue from its KV (a socket
        # that ran nothing leaves the session's KV to whoever ran it).
        if socket.session.ran and not socket.session.stored:
            await self.engine.release(socket.session.session_key, cache_salt(socket.principal.tenant))

    async def drain(self) -> None:
        # Scale-down: live sockets finish their turn, then get a clean close to
        # reconnect on (another replica; `store: true` chains continue there).
        self.draining = True
        await asyncio.gather(*[s.session.drain() for s in list(self.sockets)], return_exceptions=True)


def _local_origin(origin: str) -> bool:
    """An Origin of a page served from this machine (http(s)://localhost, 127.x, [::1], *.localhost)."""
    try:
        host = urlsplit(origin).hostname or ""
    except ValueError:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
