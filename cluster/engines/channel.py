"""A direct stream between a connection replica and an engine replica.

A session's first engine call goes through the Serve handle (Serve's router places
the session); its answer names the replica's channel (address + a secret made by
the replica, so it only ever travels inside Ray). Later turns of the session open
(or reuse) one TCP connection per engine replica and multiplex their requests on
it: no router, no gRPC or object store hop per chunk. A channel that fails before
a request's first chunk sends the caller back to the handle (which routes to a
live replica); after the first chunk, the turn fails like any engine failure.

Frames: a 4-byte big-endian length, then msgpack (never pickle: a peer can only
send data). Client -> server: [HELLO, secret], [START, n, request], [CANCEL, n].
Server -> client: [HELLO, "ok"], [CHUNK, n, pieces], [END, n], [ERROR, n, message].
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import ssl
from collections import Counter
from typing import Any, AsyncIterator, Callable, Optional, Protocol

from cluster.core.messages import EngineChunk, EngineRequest, done_of, merged
from cluster.engines.channel_codec import (  # noqa: F401 - the wire format, re-exported
    CANCEL,
    CHUNK,
    END,
    ERROR,
    HELLO,
    MAX_FRAME,
    START,
    ChannelError,
    Frames,
    _frame,
    _read,
    decode_chunk,
    decode_request,
    encode_chunk,
    encode_request,
)

log = logging.getLogger("loopserve.channel")

MAX_HELLO = 512  # the only frame read before the secret is checked
MAX_STREAMS = 256  # requests in flight on one engine replica's channel; past it, callers use the handle
# Connections one channel serves at once (a connection replica needs one): past it, a new one is
# closed at once, authenticated or not; its caller goes back to the handle.
MAX_CONNECTIONS = 1024
# Connections that have not said HELLO yet have slots of their own (and a short time to say it):
# a LAN peer holding sockets open cannot take the slots of the replicas that know the secret.
MAX_PENDING_HELLO = 64
MAX_PENDING_PER_PEER = 8
HELLO_TIMEOUT_S = 2.0


class StopSignal(Protocol):
    """What ends a stream from outside (the turn's `Stop`: a WebSocket interrupt or steer)."""

    def is_set(self) -> bool: ...

    def watch(self, on_set: Callable[[], None]) -> Callable[[], None]: ...


_STOPPED = object()  # a stream's queue entry: its caller's stop was set


# -- server (in the engine replica) ------------------------------------------------------

Handler = Callable[[EngineRequest], AsyncIterator[EngineChunk]]


def tls_contexts(tls: Any) -> tuple[Optional[ssl.SSLContext], Optional[ssl.SSLContext]]:
    """(server, client) contexts for mutual TLS under the cluster's CA (`ChannelTlsConfig`), or
    (None, None). Peers are replicas at node addresses: the CA is what is checked, not names."""
    if tls is None:
        return None, None
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.ca_file)
    server.load_cert_chain(tls.cert_file, tls.key_file)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    client.load_cert_chain(tls.cert_file, tls.key_file)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    return server, client


class ChannelServer:
    def __init__(self, handler: Handler, secret: Optional[str] = None, max_streams: int = MAX_STREAMS,
                 tls: Optional[ssl.SSLContext] = None, max_connections: int = MAX_CONNECTIONS) -> None:
        self.handler = handler
        self.max_connections = max_connections
        self.connections = 0  # authenticated
        self.pending: Counter[str] = Counter()  # peer address -> connections that have not said HELLO
        self.tls = tls
        self.max_streams = max_streams
        self.secret = secret or secrets.token_hex(16)
        self.address = ""  # host:port once started
        self._server: Optional[asyncio.base_events.Server] = None
        self._tasks: set[asyncio.Task] = set()
        self.closing = False  # draining: new requests are refused (the caller goes back to the handle)
        # Leaving with sessions retained here (`drain`): only requests it keeps are served.
        self.keeps: Optional[Callable[[EngineRequest], bool]] = None

    async def start(self, host: str, bind: Optional[str] = None) -> str:
        # The node's own address, not every interface: only replicas in the cluster dial it.
        self._server = await asyncio.start_server(self._serve, bind or host, 0, ssl=self.tls,
                                                  ssl_handshake_timeout=10 if self.tls else None)
        self.address = f"{host}:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    @property
    def endpoint(self) -> str:
        """What a caller needs to open this channel (travels only inside Ray)."""
        return f"{self.address}/{self.secret}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        running: dict[int, asyncio.Task] = {}
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        if self.connections >= self.max_connections or sum(self.pending.values()) >= MAX_PENDING_HELLO \
                or self.pending[peer] >= MAX_PENDING_PER_PEER:
            writer.close()
            return
        self.pending[peer] += 1
        authenticated = False
        try:
            try:
                hello = await asyncio.wait_for(_read(reader, MAX_HELLO), HELLO_TIMEOUT_S)
            finally:
                self.pending[peer] -= 1
                if not self.pending[peer]:
                    del self.pending[peer]
            if len(hello) != 2 or hello[0] != HELLO or not hmac.compare_digest(str(hello[1]), self.secret):
                return
            if self.connections >= self.max_connections:
                return
            self.connections += 1
            authenticated = True
            writer.write(_frame([HELLO, "ok"]))
            frames = Frames(reader)
            while True:
                msg = await frames.next()
                if msg[0] == START:
                    req = decode_request(msg[2])
                    refused = ("draining" if self.closing or (self.keeps is not None and not self.keeps(req))
                               else "busy" if len(self._tasks) >= self.max_streams else "")
                if msg[0] == START and refused:
                    # The caller goes back to the handle: Serve's router and back-pressure apply.
                    writer.write(_frame([ERROR, msg[1], refused]))
                elif msg[0] == START:
                    task = asyncio.get_running_loop().create_task(self._run(msg[1], req, writer))
                    running[msg[1]] = task
                    self._tasks.add(task)
                    task.add_done_callback(lambda t, n=msg[1]: (running.pop(n, None), self._tasks.discard(t)))
                elif msg[0] == CANCEL and msg[1] in running:
                    running[msg[1]].cancel()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, ChannelError):
            pass
        except Exception as exc:  # noqa: BLE001 - a malformed peer loses its connection, nothing else
            log.debug("engine channel peer dropped: %s", type(exc).__name__)
        finally:
            if authenticated:
                self.connections -= 1
            for task in list(running.values()):
                task.cancel()  # the caller went away: abort its generations
            writer.close()

    async def _run(self, n: int, req: EngineRequest, writer: asyncio.StreamWriter) -> None:
        stream = self.handler(req)
        try:
            async for chunk in stream:
                writer.write(_frame([CHUNK, n, encode_chunk(chunk)]))
                await writer.drain()
            writer.write(_frame([END, n]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the caller gets a failed stream, the channel lives on
            log.warning("engine request %s failed: %s", req.request_id, type(exc).__name__)
            if not writer.is_closing():
                writer.write(_frame([ERROR, n, type(exc).__name__]))
        finally:
            await stream.aclose()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def drain(self, keeps: Callable[[EngineRequest], bool]) -> None:
        """Leaving, but not yet closed: a request is served only when `keeps(req)` (its session's
        prefix is retained here); others go back to the handle, which places them on live replicas."""
        self.keeps = keeps

    async def close(self) -> None:
        """Stop taking connections and requests (callers go back to the handle, which
        routes to live replicas); running requests go on."""
        self.closing = True
        if self._server is not None:
            self._server.close()


# -- client (in the connection replica) --------------------------------------------------


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.streams: dict[int, asyncio.Queue] = {}
        self.next_id = 0
        self.closed = False
        self.reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        frames = Frames(self.reader)
        try:
            while True:
                msg = await frames.next()
                queue = self.streams.get(msg[1])
                if queue is not None:
                    queue.put_nowait(msg)
        except Exception:  # noqa: BLE001 - lost: every open stream learns it
            pass
        finally:
            self.closed = True
            for queue in self.streams.values():
                queue.put_nowait(None)
            self.writer.close()

    async def stream(self, req: EngineRequest, stop: Optional[StopSignal] = None) -> AsyncIterator[EngineChunk]:
        """The request's chunks; a `stop` set ends them at once (and aborts the generation):
        it queues behind what arrived, so the caller needs no task of its own to watch it."""
        if stop is not None and stop.is_set():
            return
        n = self.next_id = self.next_id + 1
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[n] = queue
        unwatch = stop.watch(lambda: queue.put_nowait(_STOPPED)) if stop is not None else None
        ended = False
        try:
            self.writer.write(_frame([START, n, encode_request(req)]))
            pending = None  # a message read while merging, handled next
            while True:
                msg = pending if pending is not None else await queue.get()
                pending = None
                if msg is _STOPPED:
                    return
                if msg is None:
                    raise ChannelError("the engine channel closed")
                if msg[0] == CHUNK:
                    chunk = decode_chunk(msg[2])
                    if not queue.empty():  # this consumer fell behind: what piled up goes on as one
                        chunks = [chunk]
                        while pending is None and not queue.empty():
                            later = queue.get_nowait()
                            if later is None or later is _STOPPED or later[0] != CHUNK:
                                pending = later
                            else:
                                chunks.append(decode_chunk(later[2]))
                        chunk = merged(chunks)
                    if done_of(chunk) is not None:
                        # The engine's last word: its END is on the way, the request needs no CANCEL
                        # (that could cut the replica's own work after it, e.g. its KV budget's).
                        ended = True
                    yield chunk
                elif msg[0] == END:
                    ended = True
                    return
                else:
                    raise ChannelError(f"the engine failed: {msg[2]}")
        finally:
            if unwatch is not None:
                unwatch()
            self.streams.pop(n, None)
            if not ended and not self.closed:
                self.writer.write(_frame([CANCEL, n]))  # left early: abort on the engine


class ChannelPool:
    """One connection per engine replica endpoint, opened on first use."""

    def __init__(self, connect_timeout_s: float = 2.0, tls: Optional[ssl.SSLContext] = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self._conns: dict[str, _Connection] = {}
        self._opening: dict[str, asyncio.Task] = {}

    async def _connection(self, endpoint: str) -> _Connection:
        conn = self._conns.get(endpoint)
        if conn is not None and not conn.closed:
            return conn
        task = self._opening.get(endpoint)
        if task is None:
            task = self._opening[endpoint] = asyncio.get_running_loop().create_task(self._open(endpoint))
            task.add_done_callback(lambda _: self._opening.pop(endpoint, None))
        return await asyncio.shield(task)

    async def _open(self, endpoint: str) -> _Connection:
        address, _, secret = endpoint.partition("/")
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), ssl=self.tls),
                                                    self.connect_timeout_s)
            writer.write(_frame([HELLO, secret]))
            if (await asyncio.wait_for(_read(reader), self.connect_timeout_s))[:2] != [HELLO, "ok"]:
                raise ChannelError("refused")
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:  # ssl.SSLError too
            raise ChannelError(f"cannot open the engine channel: {type(exc).__name__}") from None
        conn = self._conns[endpoint] = _Connection(reader, writer)
        return conn

    async def stream(self, endpoint: str, req: EngineRequest,
                     stop: Optional[StopSignal] = None) -> AsyncIterator[EngineChunk]:
        conn = await self._connection(endpoint)
        async for chunk in conn.stream(req, stop):
            yield chunk

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.reader_task.cancel()
        self._conns.clear()
