"""The direct engine channel over real localhost sockets (no Ray): typed chunks round-trip,
the secret is checked, leaving early aborts the generation, a dead channel is an error
the caller can fall back on."""

import asyncio
from array import array
from dataclasses import replace

import pytest

from cluster.core.messages import Generation
from cluster.core.messages import EngineDone, EngineFailure, EngineQueued, EngineRequest, TokenProgress
from cluster.engines.channel import (
    ChannelError,
    ChannelPool,
    ChannelServer,
    Frames,
    _frame,
    decode_request,
    encode_request,
)
from cluster.engines.output_parser import ReasoningPiece, TextPiece, ToolCallPiece

CHUNKS = [[EngineQueued(2, 900)], [TextPiece("hel"), TokenProgress(2)], [ReasoningPiece("hm"),
          ToolCallPiece("read", '{"p": 1}')],
          [EngineFailure(400, "no", code="c", param=None)],
          [EngineDone(10, 4, 5, "stop", replica="r", engine_s=0.5, first_token_s=0.1, channel="x")]]

PIECES = [p for c in CHUNKS for p in c]


def pieces(chunks) -> list:
    """Every piece in order: chunks that piled up behind a busy caller may come as one."""
    return [p for c in chunks for p in c]


def request(n: int = 0, **kw) -> EngineRequest:
    return EngineRequest(f"req-{n}", "sess", array("i", range(50)), Generation(16, sampling={"temperature": 0.2}, tools=({"type": "function",
                         "function": {"name": "read"}},), tool_choice={"type": "function", "name": "read"}),
                         cache_salt="salt", base_request_id="prev", base_len=40, trace={"traceparent": "00-x"},
                         sent_at_ns=123, **kw)


def test_a_request_round_trips_through_the_codec():
    import msgpack

    req = request()
    back = decode_request(msgpack.unpackb(msgpack.packb(encode_request(req), use_bin_type=True), raw=False))
    assert back == req and isinstance(back.prompt_token_ids, array)


async def test_frames_come_whole_and_in_order_however_the_bytes_are_cut():
    # One read may bring many frames or part of one; a frame over the bound is refused before it is held.
    msgs = [[3, n, "x" * (n * 997 % 70_000)] for n in range(40)]
    wire = b"".join(_frame(m) for m in msgs)
    for cut in (1, 7, 4096, len(wire)):
        reader = asyncio.StreamReader()
        for at in range(0, len(wire), cut):
            reader.feed_data(wire[at : at + cut])
        reader.feed_eof()
        frames = Frames(reader)
        assert [await frames.next() for _ in msgs] == msgs
        with pytest.raises(asyncio.IncompleteReadError):
            await frames.next()
    reader = asyncio.StreamReader()
    reader.feed_data(_frame([3, 1, "y" * 2000]))
    with pytest.raises(ChannelError, match="frame of"):
        await Frames(reader, limit=1000).next()
    for body in (7, []):  # not a list, an empty one
        reader = asyncio.StreamReader()
        reader.feed_data(_frame(body))
        with pytest.raises(ChannelError, match="malformed"):
            await Frames(reader).next()


class Engine:
    def __init__(self, delay: float = 0.0) -> None:
        self.seen: list[EngineRequest] = []
        self.closed: list[str] = []
        self.delay = delay

    async def __call__(self, req):
        self.seen.append(req)
        try:
            for chunk in CHUNKS:
                await asyncio.sleep(self.delay)
                yield chunk
        finally:
            self.closed.append(req.request_id)


async def test_chunks_stream_typed_and_requests_multiplex_on_one_connection():
    engine = Engine()
    server = ChannelServer(engine)
    await server.start("127.0.0.1", bind="127.0.0.1")
    pool = ChannelPool()
    try:
        async def one(n):
            return [c async for c in pool.stream(server.endpoint, request(n))]

        results = await asyncio.gather(*[one(n) for n in range(5)])
        # every piece, in order (chunks that piled up behind a busy caller may come as one)
        assert all(pieces(r) == PIECES for r in results)
        assert sorted(r.request_id for r in engine.seen) == [f"req-{n}" for n in range(5)]
        assert engine.seen[0].prompt_token_ids == array("i", range(50))
        assert len(pool._conns) == 1  # one connection carried all five
    finally:
        await pool.close()
        await server.close()


async def test_a_caller_that_fell_behind_gets_what_piled_up_as_one_chunk_with_its_text_joined():
    """Under load a connection replica's per-event work keeps it behind its engine: the tokens that
    arrived meanwhile go on as one delta, not one event each. A caller keeping up gets each as it came."""
    words = [f"w{i} " for i in range(40)]

    async def fast(req):
        for w in words:
            yield [TextPiece(w), TokenProgress(1)]
        yield [EngineDone(10, 4, 40, "stop", replica="r", engine_s=0.5, first_token_s=0.1)]

    async def slow(req):
        for w in words[:5]:
            await asyncio.sleep(0.02)
            yield [TextPiece(w), TokenProgress(1)]

    server = ChannelServer(fast)
    await server.start("127.0.0.1", bind="127.0.0.1")
    pool = ChannelPool()
    try:
        chunks = []
        async for chunk in pool.stream(server.endpoint, request(1)):
            chunks.append(chunk)
            await asyncio.sleep(0.05)  # busy with each chunk, as a loaded replica is
        texts = [p.text for c in chunks for p in c if isinstance(p, TextPiece)]
        assert "".join(texts) == "".join(words) and len(texts) < 10, texts
        assert sum(p.n for c in chunks for p in c if isinstance(p, TokenProgress)) == 40
        assert isinstance(chunks[-1][-1], EngineDone)
        await server.close()
        server = ChannelServer(slow)
        await server.start("127.0.0.1", bind="127.0.0.1")
        kept_up = [c async for c in pool.stream(server.endpoint, request(2))]
        assert kept_up == [[TextPiece(w), TokenProgress(1)] for w in words[:5]]
    finally:
        await pool.close()
        await server.close()


async def test_a_wrong_secret_is_refused():
    server = ChannelServer(Engine())
    await server.start("127.0.0.1", bind="127.0.0.1")
    try:
        with pytest.raises(ChannelError):
            _ = [c async for c in ChannelPool().stream(server.address + "/not-the-secret", request())]
    finally:
        await server.close()


async def test_leaving_early_aborts_the_generation_on_the_engine():
    engine = Engine(delay=0.2)
    server = ChannelServer(engine)
    await server.start("127.0.0.1", bind="127.0.0.1")
    pool = ChannelPool()
    try:
        stream = pool.stream(server.endpoint, request(7))
        first = await stream.__anext__()
        assert first == CHUNKS[0]
        await stream.aclose()
        for _ in range(50):
            if engine.closed:
                break
            await asyncio.sleep(0.02)
        assert engine.closed == ["req-7"]
        assert server.in_flight == 0
    finally:
        await pool.close()
        await server.close()


async def test_a_caller_that_stops_at_the_engines_last_word_cancels_nothing_on_the_engine():
    """A turn ends at EngineDone (the terminal event waits for no END frame); what the engine
    replica does after yielding it (its KV budget's bookkeeping) must not be cut by a CANCEL."""
    after_done = asyncio.Event()
    cancelled = []

    async def engine(req):
        yield [TextPiece("hi")]
        yield [EngineDone(10, 4, 1, "stop", replica="r", engine_s=0.1, first_token_s=0.05)]
        try:
            await asyncio.sleep(0.3)  # the replica's own work after the stream's last chunk
            after_done.set()
        except asyncio.CancelledError:
            cancelled.append(req.request_id)
            raise

    server = ChannelServer(engine)
    await server.start("127.0.0.1", bind="127.0.0.1")
    pool = ChannelPool()
    try:
        stream = pool.stream(server.endpoint, request(3))
        async for chunk in stream:
            if isinstance(chunk[-1], EngineDone):
                break
        await stream.aclose()
        await asyncio.wait_for(after_done.wait(), 5)
        assert cancelled == []
    finally:
        await pool.close()
        await server.close()


async def test_a_stop_ends_the_stream_at_once_and_aborts_the_generation():
    """A WebSocket interrupt or steer sets the turn's stop: the channel's stream ends on it
    without waiting for the engine's next chunk (no reader task of the caller's own watches it)."""
    from cluster.core.turn.turn import Stop

    engine = Engine(delay=1.0)
    server = ChannelServer(engine)
    await server.start("127.0.0.1", bind="127.0.0.1")
    pool = ChannelPool()
    stop = Stop()
    try:
        stream = pool.stream(server.endpoint, request(9), stop)
        assert await stream.__anext__() == CHUNKS[0]
        asyncio.get_running_loop().call_later(0.05, stop.set, "interrupted")
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert asyncio.get_running_loop().time() - t0 < 0.5  # not the engine's next chunk (1 s away)
        for _ in range(50):
            if engine.closed:
                break
            await asyncio.sleep(0.02)
        assert engine.closed == ["req-9"]  # aborted on the engine
        assert stop._watchers == []  # the stream stopped watching
    finally:
        await pool.close()
        await server.close()


async def test_a_channel_that_is_gone_is_an_error_before_the_first_chunk():
    server = ChannelServer(Engine())
    await server.start("127.0.0.1", bind="127.0.0.1")
    endpoint = server.endpoint
    await server.close()
    server._server = None
    await asyncio.sleep(0.05)
    with pytest.raises(ChannelError):
        _ = [c async for c in ChannelPool(connect_timeout_s=1).stream(endpoint, request())]


async def test_a_draining_server_refuses_new_requests_on_open_connections_and_finishes_running_ones():
    engine = Engine(delay=0.1)
    server = ChannelServer(engine)
    await server.start("127.0.0.1", bind="127.0.0.1")
    pool = ChannelPool()
    try:
        running = pool.stream(server.endpoint, request(1))
        assert await running.__anext__() == CHUNKS[0]
        await server.close()  # the replica starts draining; the connection stays open
        with pytest.raises(ChannelError):  # a new request on it fails before any chunk: fall back
            _ = [c async for c in pool.stream(server.endpoint, request(2))]
        rest = [c async for c in running]
        assert pieces(rest) == pieces(CHUNKS[1:])  # the running one finished
        assert [r.request_id for r in engine.seen] == ["req-1"]
    finally:
        await pool.close()


async def test_the_server_binds_the_nodes_address_not_every_interface():
    server = ChannelServer(Engine())
    await server.start("127.0.0.1")
    try:
        assert server._server.sockets[0].getsockname()[0] == "127.0.0.1"
    finally:
        await server.close()


async def _raw(server, data: bytes) -> bytes:
    host, port = server.address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(100), 5)  # b"": the server hung up
    finally:
        writer.close()


async def test_before_the_secret_only_a_small_hello_is_read_and_malformed_ones_just_close(caplog):
    import struct

    import msgpack

    server = ChannelServer(Engine())
    await server.start("127.0.0.1")
    try:
        # a 256 MiB length before authenticating: refused without reading it
        assert await _raw(server, struct.pack(">I", 256 * 1024 * 1024) + b"x" * 1000) == b""
        for junk in (msgpack.packb(7), msgpack.packb([]), msgpack.packb({"a": 1}), b"\xc1"):
            assert await _raw(server, struct.pack(">I", len(junk)) + junk) == b""
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
        # and the server still serves a real caller
        pool = ChannelPool()
        assert pieces([c async for c in pool.stream(server.endpoint, request())]) == PIECES
        await pool.close()
    finally:
        await server.close()


async def test_past_its_stream_bound_the_server_sends_callers_back_to_the_handle():
    engine = Engine(delay=0.2)
    server = ChannelServer(engine, max_streams=2)
    await server.start("127.0.0.1")
    pool = ChannelPool()
    try:
        async def one(n):
            try:
                return [c async for c in pool.stream(server.endpoint, request(n))]
            except ChannelError:
                return None

        results = await asyncio.gather(*[one(n) for n in range(4)])
        assert sum(r is not None and pieces(r) == PIECES for r in results) == 2 and results.count(None) == 2
        assert len(engine.seen) == 2
    finally:
        await pool.close()
        await server.close()


def _cluster_ca(tmp_path, name: str):
    """A CA and one node certificate it signed (what a cluster's cert-manager would mount)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def write(path, key, cert):
        path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
        path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)).sign(ca_key, hashes.SHA256()))
    write(tmp_path / f"{name}-ca", ca_key, ca)
    write(tmp_path / f"{name}-node", key, cert)
    from cluster.config import ChannelTlsConfig

    return ChannelTlsConfig(cert_file=str(tmp_path / f"{name}-node.pem"), key_file=str(tmp_path / f"{name}-node.key"),
                            ca_file=str(tmp_path / f"{name}-ca.pem"))


async def test_mutual_tls_carries_the_channel_and_refuses_peers_outside_the_cluster_ca(tmp_path):
    """The channel's optional TLS (multi-node). Both sides present a certificate
    of the cluster's CA; a plaintext peer or one from another CA gets nothing."""
    from cluster.engines.channel import tls_contexts

    server_tls, client_tls = tls_contexts(_cluster_ca(tmp_path, "ours"))
    _, foreign_tls = tls_contexts(_cluster_ca(tmp_path, "theirs"))
    engine = Engine()
    server = ChannelServer(engine, tls=server_tls)
    await server.start("127.0.0.1", bind="127.0.0.1")
    try:
        pool = ChannelPool(tls=client_tls)
        assert pieces([c async for c in pool.stream(server.endpoint, request())]) == PIECES
        await pool.close()
        for outsider in (ChannelPool(), ChannelPool(tls=foreign_tls)):  # plaintext; another cluster's CA
            with pytest.raises(ChannelError):
                _ = [c async for c in outsider.stream(server.endpoint, request(1))]
        assert [r.request_id for r in engine.seen] == ["req-0"]
    finally:
        await server.close()


async def test_connections_that_do_not_say_hello_cannot_take_the_authenticated_slots():
    """Idle or unauthenticated connections cannot pile up on a
    channel, nor take the slots of the replicas that know its secret."""
    from cluster.engines.channel import HELLO_TIMEOUT_S, MAX_PENDING_PER_PEER

    server = ChannelServer(Engine(), max_connections=2)
    await server.start("127.0.0.1", bind="127.0.0.1")
    host, port = server.address.split(":")
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(MAX_PENDING_PER_PEER)]  # never say HELLO
    pools = [ChannelPool() for _ in range(3)]
    try:
        await asyncio.sleep(0.1)
        assert server.pending["127.0.0.1"] == MAX_PENDING_PER_PEER and server.connections == 0
        extra_r, extra_w = await asyncio.open_connection(host, int(port))  # one more from that peer: closed at once
        assert await asyncio.wait_for(extra_r.read(), 1) == b""
        extra_w.close()
        await asyncio.sleep(HELLO_TIMEOUT_S + 0.3)  # the idle ones are dropped after the HELLO timeout
        assert not server.pending
        for r, _ in idle:
            assert await asyncio.wait_for(r.read(), 1) == b""
        # authenticated connections have max_connections slots of their own
        for n, pool in enumerate(pools[:2]):
            assert pieces([c async for c in pool.stream(server.endpoint, request(n))]) == PIECES
        assert server.connections == 2
        with pytest.raises(ChannelError):  # the third is closed
            _ = [c async for c in pools[2].stream(server.endpoint, request(9))]
    finally:
        for _, w in idle:
            w.close()
        for pool in pools:
            await pool.close()
        await server.close()


async def test_a_leaving_replica_serves_the_sessions_it_retains_and_sends_others_back():
    engine = Engine()
    server = ChannelServer(engine)
    await server.start("127.0.0.1", bind="127.0.0.1")
    pool = ChannelPool()
    try:
        server.drain(lambda req: req.session_key == "kept")
        assert pieces([c async for c in pool.stream(server.endpoint, replace(request(1), session_key="kept"))]) == PIECES
        with pytest.raises(ChannelError):  # a session without a prefix here: placed on a live replica
            _ = [c async for c in pool.stream(server.endpoint, replace(request(2), session_key="other"))]
        assert [r.request_id for r in engine.seen] == ["req-1"]
    finally:
        await pool.close()
        await server.close()
