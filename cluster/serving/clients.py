"""Clients of the other deployments over Ray Serve handles, behind the turn core's ports.

Every call goes through one `RetryPolicy`: a replica that died (before answering,
or before an engine stream's first chunk) is retried on another one or on its
replacement; anything else is the caller's to handle.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import OrderedDict
from dataclasses import replace
from typing import Any, AsyncIterator, Optional

from opentelemetry import context as otel_context
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from cluster import telemetry
from cluster.config import LoopserveConfig
from cluster.core.messages import KV_MOVE, EngineChunk, EngineFailure, EngineRequest, RenderJob, done_of
from cluster.core.render.renderer import IncrementalRenderer, RenderResult, render_job
from cluster.core.retry import RetryPolicy
from cluster.core.safety.classifiers import SafetyService
from cluster.core.turn.turn import Stop, until_stopped
from cluster.engines.channel import ChannelError, ChannelPool
from cluster.serve_plugins.kv_router import PLACEMENT_SEP

log = logging.getLogger("loopserve.connection")


def replica_gone(exc: BaseException) -> bool:
    return isinstance(exc, (RayActorError, ActorUnavailableError))


def deployment_retry(config: LoopserveConfig) -> RetryPolicy:
    # 0.6 s, 0.9 s, 1.35 s, ...: the default 5 retries (~8 s) cover a replica restart.
    return RetryPolicy(retries=config.routing.engine_retries, backoff_s=0.6, multiplier=1.5, max_delay_s=3.0)


class RenderClient:
    """The render port: a delta inline when this replica has the tokenizer; a full render on the
    RenderActor, or in a worker thread of this replica when the app has no render replicas
    (`render_in_connection`)."""

    def __init__(self, handle: Optional[DeploymentHandle], retry: RetryPolicy,
                 local: Optional[IncrementalRenderer] = None) -> None:
        if handle is None and local is None:
            raise ValueError("a RenderClient needs a RenderActor handle or a local renderer")
        self.handle, self.retry, self.local = handle, retry, local
        self.local_mismatches = 0

    async def __call__(self, job: RenderJob) -> Optional[RenderResult]:
        if self.local is not None and job.inline_ok:
            result, mismatch = render_job(self.local, job)  # O(new items): on the loop
        elif self.handle is None:
            # O(history): off the event loop, which serves every socket of this replica.
            result, mismatch = await asyncio.to_thread(render_job, self.local, job)
        else:
            return await self.retry.call("render", lambda: self.handle.render.remote(job), replica_gone)
        if mismatch:
            self.local_mismatches += 1
            log.error("incremental render differs from the full render; used the full one")
        return result

    async def stats(self) -> dict[str, Any]:
        if self.handle is None:
            return self.local_stats()
        return await self.handle.stats.remote()

    def local_stats(self) -> Optional[dict[str, int]]:
        if self.local is None:
            return None
        return {**self.local.stats(), "mismatches": self.local_mismatches}


class SafetyClient:
    """The safety port: the local classifiers in this replica (no hop before the first
    token), or the SafetyActor (model-based guards)."""

    def __init__(self, retry: RetryPolicy, *, inline: Optional[SafetyService] = None,
                 handle: Optional[DeploymentHandle] = None) -> None:
        self.retry, self.inline, self.handle = retry, inline, handle

    async def __call__(self, texts: list[str]) -> list[dict[str, Any]]:
        if self.inline is not None:
            return await self.inline.classify(texts)  # the caller's span is current
        # The caller's span is current (TurnSafety, post-work): it rides along.
        carrier = telemetry.inject(otel_context.get_current())
        return await self.retry.call("safety", lambda: self.handle.classify.remote(texts, carrier), replica_gone)

    async def stats(self) -> dict[str, Any]:
        return self.inline.stats() if self.inline is not None else await self.handle.stats.remote()


class EngineClient:
    """The engine port: a stream of chunks from the replica the session is placed on.

    A session's first turn goes through the Serve handle (its router places the session);
    later turns stream from that replica's direct channel (`cluster/engines/channel.py`).
    A channel that fails before the first chunk sends the turn back to the handle.

    One placement truth: a continuation names the replica its chain last ran on
    (`EngineRequest.placement`, recorded with the chain's state and in the store), and the
    placement router sends it there from any connection replica (`PLACEMENT_SEP`); a replica
    that is gone hands the session back to the router, which places it again (counted by the
    turn as a moved session)."""

    def __init__(self, handle: DeploymentHandle, retry: RetryPolicy, direct: bool = True,
                 max_sessions: int = 100_000, tls: Optional[ssl.SSLContext] = None) -> None:
        self.handle = handle.options(stream=True)
        self.retry = retry
        self.pool = ChannelPool(tls=tls) if direct else None
        self.endpoints: OrderedDict[str, tuple[str, str]] = OrderedDict()  # session key -> (channel, replica), LRU
        self._placing: dict[str, asyncio.Future] = {}  # session key -> its placement call in flight
        self._routing: dict[str, asyncio.Future] = {}  # session key -> its last handle stream, set once routed
        self.max_sessions = max_sessions
        self.direct_turns = self.handle_turns = self.channel_fallbacks = self.migrations = 0
        self.placed_by_chain = 0  # sessions this replica had not placed, sent where their chain's prefix is
        self._route: OrderedDict[str, str] = OrderedDict()  # session key -> routing key, for moved sessions

    async def __call__(self, req: EngineRequest, stop: Optional[Stop] = None) -> AsyncIterator[EngineChunk]:
        """The engine's chunks; a replica that had no KV room for the session for too long
        sends it elsewhere once (`KV_MOVE`): it is placed again under a new routing key (the
        placement router puts it where there is headroom) and the same request goes there
        (a tail prompt is then resent whole by the caller: the new replica lacks its base)."""
        if not req.moved and req.session_key in self._route:
            req = replace(req, moved=True)  # moved once already: it waits where it is now
        async for chunk in self._call(req, stop):
            if (not req.moved and chunk and isinstance(chunk[0], EngineFailure) and chunk[0].code == KV_MOVE):
                self.migrations += 1
                self._route[req.session_key] = f"{req.session_key}#moved"
                while len(self._route) > self.max_sessions:
                    self._route.popitem(last=False)
                self.endpoints.pop(req.session_key, None)
                async for moved in self._call(replace(req, moved=True), stop):
                    yield moved
                return
            yield chunk

    def _routing_key(self, session_key: str, placement: str = "") -> str:
        route = self._route.get(session_key)
        if route is not None:
            return route  # moved for lack of room: placed again, wherever it was
        return f"{session_key}{PLACEMENT_SEP}{placement}" if placement else session_key

    async def _call(self, req: EngineRequest, stop: Optional[Stop]) -> AsyncIterator[EngineChunk]:
        endpoint = await self._endpoint(req.session_key, req.placement) if self.pool is not None else None
        if endpoint:
            started = False
            try:
                async for chunk in self.pool.stream(endpoint, req, stop):
                    started = True
                    if done_of(chunk) is not None:
                        self.direct_turns += 1  # counted here: a caller may stop reading at the engine's last word
                    yield chunk
                return
            except ChannelError:
                if started:
                    raise
                # The replica went away (or restarted): Serve's router places the session again.
                self.channel_fallbacks += 1
                self.endpoints.pop(req.session_key, None)
        self.handle_turns += 1
        # A replica that died before the first chunk: the router moves the session to a
        # live replica (a full prefill there). Mid-stream: the turn fails.
        chunks = until_stopped(self.retry.stream("engine", lambda: self._stream(req), replica_gone), stop)
        try:
            async for chunk in chunks:
                done = done_of(chunk)
                if self.pool is not None and done is not None and done.channel:
                    self._remember(req.session_key, done.channel, done.replica)
                yield chunk
        finally:
            await chunks.aclose()

    async def _endpoint(self, session_key: str, placement: str = "") -> str:
        """The channel of the replica Serve's router places this session on: remembered, or
        asked once with a unary call (a handle *stream* costs far more: every chunk crosses
        Serve's streaming path, which slows a CPU engine's decode in the same process). A
        remembered channel of another replica than the chain's last one is stale (another
        connection replica ran the chain since): the router places it again."""
        known = self.endpoints.get(session_key)
        if known is not None and (not placement or known[1] == placement or session_key in self._route):
            self.endpoints.move_to_end(session_key)
            return known[0]
        if placement:
            self.placed_by_chain += 1
        # One placement call per session at a time: concurrent first turns of a session (two
        # WebSocket lanes) share it. Concurrent same-session requests can be left unrouted by
        # Ray's ConsistentHashRouter (2.60): the second one hung until its client gave up.
        placing = self._placing.get(session_key)
        if placing is None:
            placing = self._placing[session_key] = asyncio.ensure_future(self._place(session_key, placement))
            placing.add_done_callback(lambda _: self._placing.pop(session_key, None))
        return await asyncio.shield(placing)

    async def _place(self, session_key: str, placement: str = "") -> str:
        try:
            handle = self.handle.options(stream=False, session_id=self._routing_key(session_key, placement))
            endpoint, replica = await self.retry.call("engine placement", lambda: handle.channel_endpoint.remote(),
                                                      replica_gone)
        except Exception:  # noqa: BLE001 - no placement answer: the handle stream places the turn
            return ""
        if endpoint:
            self._remember(session_key, endpoint, replica)
        return endpoint

    def _remember(self, session_key: str, endpoint: str, replica: str) -> None:
        self.endpoints[session_key] = (endpoint, replica)
        self.endpoints.move_to_end(session_key)
        while len(self.endpoints) > self.max_sessions:
            self.endpoints.popitem(last=False)

    async def _stream(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        # The session key rides on every engine call: the consistent-hash router
        # sends all turns of a session to the replica holding its prefix KV.
        # Routed one at a time per session (each waits for the one before it to be placed,
        # i.e. to stream its first chunk): see `_endpoint` on same-session bursts.
        key = req.session_key
        before = self._routing.get(key)
        routed = asyncio.get_running_loop().create_future()
        self._routing[key] = routed
        gen = None
        finished = False
        try:
            if before is not None:
                await asyncio.shield(before)
            gen = self.handle.options(session_id=self._routing_key(key, req.placement)).generate.remote(req)
            async for chunk in gen:
                if not routed.done():
                    routed.set_result(None)
                if done_of(chunk) is not None:
                    finished = True  # the engine's last word: a caller that stops here cancels nothing
                yield chunk
            finished = True
        finally:
            if not routed.done():
                routed.set_result(None)
            if self._routing.get(key) is routed:
                del self._routing[key]
            if gen is not None and not finished:
                gen.cancel()  # abandoned or failed: cancel (and abort) on the engine

    async def release(self, session_key: str, cache_salt: Optional[str]) -> None:
        """The session will not be back: its engine replica frees the KV it retained for it
        (routed like its turns, by the session key). Best effort: retention also expires."""
        try:
            handle = self.handle.options(stream=False, session_id=self._routing_key(session_key))
            await asyncio.wait_for(handle.release_session.remote(session_key, cache_salt), timeout=10)
        except Exception:  # noqa: BLE001 - a gone replica holds nothing
            log.debug("engine release failed for a session", exc_info=True)

    def counters(self) -> dict[str, int]:
        return {"direct_turns": self.direct_turns, "handle_turns": self.handle_turns,
                "channel_fallbacks": self.channel_fallbacks, "sessions_with_channel": len(self.endpoints),
                "kv_migrations": self.migrations, "placed_by_chain": self.placed_by_chain}

    async def stats(self, session: Optional[str] = None) -> dict[str, Any]:
        handle = self.handle.options(stream=False)
        if session:
            handle = handle.options(session_id=session)
        return await handle.stats.remote()
