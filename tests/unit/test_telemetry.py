"""Traces and metrics of a turn, in-process: the span tree, propagation, attributes, no-op when off."""

import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster import telemetry
from cluster.config import TelemetryConfig
from cluster.core.safety.classifiers import PolicyClassifier
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.post_work import PostWorkQueue, UsageMeter
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.requests import parse_request
from tests.support.harness import CountingSafety, InProcessStack

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def otel(tokenizer):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    tracer = provider.get_tracer("test")
    post = PostWorkQueue({"usage": UsageMeter()}, tracer=tracer)
    stack = InProcessStack(tokenizer, safety=CountingSafety(PolicyClassifier({"policy": ["forbidden"]})), post_work=post,
                           tracer=tracer, metrics=telemetry.Metrics(meter))

    # A render deployment's side of the hop: the job carries the W3C context.
    local_render = stack.render

    async def remote_render(job):
        with tracer.start_as_current_span("render.execute", context=telemetry.extract(job.trace)):
            return await local_render(job)

    stack.driver.preparer.render = remote_render
    return stack, exporter, reader, post


def metric_points(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


async def turn(stack, cache, body, received_at=None, parsed_at=None, **scope):
    return [ev async for ev in stack.driver.run(TurnRequest(
        parse_request(body), TurnScope(cache, session_key="user-session-secret", **scope), received_at=received_at,
        parsed_at=parsed_at))]


async def test_a_turn_is_one_span_tree_under_the_callers_traceparent(otel):
    stack, exporter, _, post = otel
    cache = SessionCache()
    parent = telemetry.extract({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    received = time.perf_counter()
    evs = await turn(stack, cache, {"input": "read the readme", "tools": TOOLS}, trace_parent=parent,
                     received_at=received, parsed_at=time.perf_counter(), transport="websocket")
    first = evs[-1]["response"]
    evs = await turn(stack, cache, {"previous_response_id": first["id"], "tools": TOOLS, "input": [
        {"type": "function_call_output", "call_id": first["output"][0]["call_id"], "output": "# readme"},
        {"type": "message", "role": "user", "content": "now fix it"}]},
        trace_parent=parent, transport="websocket")
    second = evs[-1]["response"]
    await post.drain()

    spans = exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}
    roots = [s for s in spans if s.name == "response.create"]
    assert len(roots) == 2
    assert all(format(r.parent.span_id, "016x") == CLIENT_SPAN for r in roots)
    by_id = {s.context.span_id: s for s in spans}

    def root_of(span):
        while span.name != "response.create":
            span = by_id[span.parent.span_id]
        return span

    tree = {r.attributes["loopserve.response_id"]: sorted(s.name for s in spans if root_of(s) is r) for r in roots}
    for names in tree.values():
        for expected in ("resolve_context", "render", "render.execute", "safety.input", "engine", "stream_events",
                         "post_work.usage"):
            assert expected in names, (expected, names)
    assert "parse" in tree[first["id"]]  # parse timing given for the first turn only

    r2 = next(r for r in roots if r.attributes["loopserve.response_id"] == second["id"])
    assert r2.attributes["loopserve.cache"] == "hit"
    assert r2.attributes["gen_ai.usage.input_tokens"] == second["usage"]["input_tokens"]
    assert r2.attributes["loopserve.cached_tokens"] == second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert r2.attributes["loopserve.status"] == "completed"
    assert r2.attributes["loopserve.transport"] == "websocket"
    # The session key is exported hashed, and no span carries content.
    assert r2.attributes["loopserve.session"] == telemetry.hash_key("user-session-secret")
    for s in spans:
        for v in s.attributes.values():
            assert "user-session-secret" not in str(v) and "readme" not in str(v)


async def test_rejected_request_ends_its_span_with_an_error(otel):
    stack, exporter, reader, _ = otel
    with pytest.raises(Exception):
        await turn(stack, SessionCache(), {"previous_response_id": "resp_unknown", "input": "hi"})
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "response.create"]
    assert root.status.status_code.name == "ERROR"
    assert root.attributes["loopserve.cache"] == "miss"
    assert root.attributes["error.type"] == "previous_response_not_found"
    points = metric_points(reader)
    assert [p.attributes for p in points["loopserve.turns"]] == [{"transport": "http", "status": "rejected"}]


async def test_metrics_follow_the_turns(otel):
    stack, _, reader, _ = otel
    cache = SessionCache()
    prev = None
    for i in range(3):
        body = {"input": f"turn {i}"}
        if prev:
            body["previous_response_id"] = prev
        prev = (await turn(stack, cache, body))[-1]["response"]["id"]
    await turn(stack, cache, {"input": "a forbidden word"})  # blocked by the policy classifier
    points = metric_points(reader)
    turns = {p.attributes["status"]: p.value for p in points["loopserve.turns"]}
    assert turns == {"completed": 3, "incomplete": 1}
    assert {p.attributes["result"]: p.value for p in points["loopserve.session_cache.lookups"]} == {"hit": 2}
    assert sum(p.value for p in points["loopserve.safety.blocks"]) == 1
    (overhead,) = points["loopserve.turn.overhead"]
    assert overhead.count == 4 and overhead.sum > 0
    assert sum(p.value for p in points["loopserve.tokens.output"]) > 0


async def test_off_by_default_exports_nothing(tokenizer):
    assert TelemetryConfig().enabled is False
    assert telemetry.setup(TelemetryConfig(), "test") is False
    stack = InProcessStack(tokenizer)  # the global (no-op) tracer
    evs = [ev async for ev in stack.driver.run(TurnRequest(parse_request({"input": "hi"}), TurnScope(SessionCache(), session_key="s")))]
    assert evs[-1]["response"]["status"] == "completed"
    assert telemetry.inject(None) is None
    assert stack.render_jobs[0].trace is None  # nothing travels when not recording


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_configured_otlp_exporter_reaches_a_receiver(protocol):
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from tests.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver

    receiver = OtlpGrpcReceiver() if protocol == "grpc" else OtlpHttpReceiver()
    with receiver:
        span_exporter, metric_exporter = telemetry._exporters(
            TelemetryConfig(enabled=True, protocol=protocol, endpoint=receiver.url))
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
        with provider.get_tracer("t").start_as_current_span("response.create") as root:
            root.set_attribute("loopserve.response_id", "resp_1")
        provider.force_flush(5000)
        assert receiver.wait_for(lambda r: len(r.spans) == 1, timeout=10)
        assert receiver.spans[0]["name"] == "response.create"
        assert receiver.spans[0]["attributes"]["loopserve.response_id"] == "resp_1"
        provider.shutdown()
        metric_exporter.shutdown()


def test_a_clients_sampled_flag_does_not_override_the_servers_ratio(monkeypatch):
    """The server samples; a client's `traceparent` only joins its trace."""
    from opentelemetry import trace as otel_trace

    header = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}  # sampled
    monkeypatch.setattr(telemetry, "_client_sampling", (0.0, False))
    parent = otel_trace.get_current_span(telemetry.extract_headers(header)).get_span_context()
    assert parent.trace_id == 0x0AF7651916CD43DD8448EB211C80319C and not parent.trace_flags.sampled
    monkeypatch.setattr(telemetry, "_client_sampling", (1.0, False))
    assert otel_trace.get_current_span(telemetry.extract_headers(header)).get_span_context().trace_flags.sampled
    monkeypatch.setattr(telemetry, "_client_sampling", (0.0, True))  # clients you run yourselves
    assert otel_trace.get_current_span(telemetry.extract_headers(header)).get_span_context().trace_flags.sampled


def test_otlp_over_tls_verifies_the_collector(tmp_path):
    """First audit #15: the RayService exported traces in plaintext. With `ca_file`, export is TLS
    and the collector's certificate is checked: one signed by another CA gets nothing."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from tests.otlp_receiver import OtlpGrpcReceiver

    now = datetime.datetime.now(datetime.timezone.utc)

    def ca(name):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now)
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    ca_key, ca_cert = ca("collector ca")
    _, other_ca = ca("another ca")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    (tmp_path / "ca.pem").write_bytes(pem(ca_cert))
    (tmp_path / "other.pem").write_bytes(pem(other_ca))
    tls = (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()), pem(cert))

    def export(receiver, ca_file):
        span_exporter, metric_exporter = telemetry._exporters(
            TelemetryConfig(enabled=True, protocol="grpc", endpoint=receiver.url, ca_file=ca_file))
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(span_exporter, export_timeout_millis=3000))
        with provider.get_tracer("t").start_as_current_span("response.create"):
            pass
        provider.force_flush(5000)
        provider.shutdown()
        metric_exporter.shutdown()

    with OtlpGrpcReceiver(tls=tls) as receiver:
        export(receiver, str(tmp_path / "other.pem"))  # the collector's certificate is not trusted: nothing sent
        assert not receiver.wait_for(lambda r: r.spans, timeout=1)
        export(receiver, str(tmp_path / "ca.pem"))
        assert receiver.wait_for(lambda r: len(r.spans) == 1, timeout=10)
