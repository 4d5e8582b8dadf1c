"""OpenTelemetry traces and metrics for every loopserve process.

Each deployment calls `setup(config.telemetry, role)` once in its constructor:
it installs the process's tracer and meter providers with OTLP exporters
(gRPC or HTTP) when telemetry is enabled. When it is off, the OpenTelemetry
API's no-op tracer and meter are used: a span costs a no-op object, nothing is
exported. Trace context crosses deployment handle calls as a W3C carrier dict
(`inject`/`extract`) inside the job, request or call arguments, so the spans
of one turn form one tree across the connection, render, safety and engine
processes.

Spans never carry prompt or output text; session keys are hashed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Optional

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer

from cluster.config import TelemetryConfig

log = logging.getLogger(__name__)

TRACER_NAME = "loopserve"
_installed: Optional[tuple[Any, Any]] = None  # (TracerProvider, MeterProvider) of this process
# (sample_ratio, honor_client_sampling) for traces a client starts (`extract_headers`).
_client_sampling: tuple[float, bool] = (1.0, False)


def route_logs() -> None:
    """loopserve's loggers (`loopserve.*`, `cluster.*`) write where the Serve replica's own
    logs go: inside a replica they have no handler of their own, so their warnings (retries,
    failed engine streams, failed post-work) would reach no log file."""
    serve_handlers = logging.getLogger("ray.serve").handlers
    for name in ("loopserve", "cluster"):
        ours = logging.getLogger(name)
        if ours.handlers or not serve_handlers:
            continue
        for handler in serve_handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def setup(config: TelemetryConfig, role: str) -> bool:
    """Install this process's providers (once); returns whether telemetry is on."""
    global _installed
    route_logs()
    if not config.enabled or _installed is not None:
        return _installed is not None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({
        "service.name": config.service_name,
        "service.instance.id": f"{role}-{os.getpid()}",
        "loopserve.role": role,
        "process.pid": os.getpid(),
    })
    span_exporter, metric_exporter = _exporters(config)
    tracer_provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=config.export_delay_ms))
    readers = [PeriodicExportingMetricReader(metric_exporter, export_interval_millis=config.metrics_interval_ms)]
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    _installed = (tracer_provider, meter_provider)
    global _client_sampling
    _client_sampling = (config.sample_ratio, config.honor_client_sampling)
    log.info("telemetry on: %s -> %s (%s)", role, config.endpoint, config.protocol)
    return True


def _exporters(config: TelemetryConfig):
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if config.ca_file:  # TLS, the collector's certificate checked against this CA
            import grpc

            with open(config.ca_file, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            return (OTLPSpanExporter(endpoint=config.endpoint, insecure=False, credentials=creds),
                    OTLPMetricExporter(endpoint=config.endpoint, insecure=False, credentials=creds))
        return (OTLPSpanExporter(endpoint=config.endpoint, insecure=config.insecure),
                OTLPMetricExporter(endpoint=config.endpoint, insecure=config.insecure))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    base = config.endpoint.rstrip("/")
    tls = {"certificate_file": config.ca_file} if config.ca_file else {}
    return (OTLPSpanExporter(endpoint=base + "/v1/traces", **tls),
            OTLPMetricExporter(endpoint=base + "/v1/metrics", **tls))


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered now (tests, shutdown)."""
    if _installed is not None:
        _installed[0].force_flush(timeout_ms)
        _installed[1].force_flush(timeout_ms)


def tracer() -> Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(ctx: Optional[Context]) -> Optional[dict[str, str]]:
    """W3C trace context of `ctx` as a dict to send along a handle call (None when not recording)."""
    if ctx is None or not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Optional[dict[str, str]]) -> Optional[Context]:
    return propagate.extract(carrier) if carrier else None


def extract_headers(headers: Any) -> Optional[Context]:
    """The caller's trace context from request (or WebSocket upgrade) headers, if it sent one."""
    value = headers.get("traceparent")
    if not value:
        return None
    carrier = {"traceparent": value}
    if headers.get("tracestate"):
        carrier["tracestate"] = headers.get("tracestate")
    ctx = propagate.extract(carrier)
    ratio, honor = _client_sampling
    if honor:
        return ctx
    # The client's trace id is kept (its spans and ours join up), its sampled flag is not: a
    # client setting it on every request would otherwise override `sample_ratio` and make the
    # server record and export every turn it sends.
    parent = trace.get_current_span(ctx).get_span_context()
    if not parent.is_valid:
        return None
    flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if random.random() < ratio else trace.TraceFlags.DEFAULT)
    return trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
        parent.trace_id, parent.span_id, is_remote=True, trace_flags=flags, trace_state=parent.trace_state)))


def context_of(span: Span) -> Context:
    return trace.set_span_in_context(span)


def hash_key(key: str) -> str:
    """Session keys are identifiers users chose: export a hash, not the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def ns_at(perf: float) -> int:
    """Wall-clock nanoseconds of an earlier `time.perf_counter()` reading."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def span_between(tr: Tracer, name: str, parent: Optional[Context], start_ns: int, end_ns: int,
                 attributes: Optional[dict[str, Any]] = None) -> None:
    """A span for an interval measured elsewhere (queue wait, prefill, decode)."""
    span = tr.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    span.end(end_time=max(end_ns, start_ns))


class Metrics:
    """The one place a connection replica counts things: OpenTelemetry instruments (no-op
    until a meter provider is installed) and the in-process counters `/loopserve/stats`
    shows, updated together by the same call."""

    def __init__(self, meter: Optional[metrics.Meter] = None, recent_turns: int = 1024) -> None:
        m = meter or metrics.get_meter(TRACER_NAME)
        self.turns = m.create_counter("loopserve.turns", description="responses created, by transport and status")
        self.overhead = m.create_histogram("loopserve.turn.overhead", unit="ms",
                                           description="server time of a turn minus engine time")
        self.ttft = m.create_histogram("loopserve.turn.ttft", unit="ms", description="time to the first output token")
        self.output_tokens = m.create_counter("loopserve.tokens.output", description="generated tokens")
        self.decode_rate = m.create_histogram("loopserve.tokens.per_second", unit="1/s",
                                              description="decode rate of a turn")
        self.cache_lookups = m.create_counter("loopserve.session_cache.lookups",
                                              description="previous_response_id lookups, by result (hit|store|miss)")
        self.safety_blocks = m.create_counter("loopserve.safety.blocks", description="turns stopped by the content filter")
        self.render_audits = m.create_counter(
            "loopserve.render.audits", description="sampled delta renders checked against a full render, by result")
        self.render_fallbacks = m.create_counter(
            "loopserve.render.fallbacks", description="delta renders done as full renders, by reason")
        self.store_write = m.create_histogram("loopserve.store.write_latency", unit="ms",
                                              description="durable store write latency")
        self.connections = m.create_up_down_counter("loopserve.connections.active",
                                                    description="open WebSocket connections")
        self._meter = m
        # In-process counters (stats route), kept by the same calls as the instruments.
        self.turn_status: Counter[str] = Counter()  # how turns ended (cancelled = the client went away)
        self.turn_transport: Counter[str] = Counter()  # websocket | http
        self.blocked_turns = 0
        # Continuations whose engine replica differed from their parent's (replica died,
        # or backpressure fallback): each one re-prefilled.
        self.session_moves = 0
        # Continuations whose prompt tail reached a replica without its base: resent whole.
        self.prompt_resends = 0
        self.compactions = 0  # turns that compacted their context (context_management)
        self.open_sockets = 0
        self.timings: deque = deque(maxlen=recent_turns)  # recent turns' TurnTiming
        self.store_write_seconds: deque[float] = deque(maxlen=1000)

    def turn_ended(self, transport: str, status: str) -> None:
        self.turn_status[status] += 1
        self.turn_transport[transport] += 1
        self.turns.add(1, {"transport": transport, "status": status})

    def cache_lookup(self, result: str) -> None:
        self.cache_lookups.add(1, {"result": result})

    def safety_blocked(self, stage: str) -> None:
        self.blocked_turns += 1
        self.safety_blocks.add(1, {"stage": stage})

    def render_audited(self, exact: bool) -> None:
        self.render_audits.add(1, {"result": "exact" if exact else "mismatch"})

    def render_fell_back(self, reason: str) -> None:
        self.render_fallbacks.add(1, {"reason": reason})

    def session_moved(self) -> None:
        self.session_moves += 1

    def compacted(self) -> None:
        self.compactions += 1

    def prompt_resent(self) -> None:
        self.prompt_resends += 1

    def turn_timed(self, timing: Any, output_tokens: int = 0) -> None:
        """A finished turn's `TurnTiming` (server overhead, TTFT, decode rate)."""
        self.overhead.record((timing.total - timing.engine - timing.tool_wait) * 1000)
        if timing.first_token:
            self.ttft.record(timing.first_token * 1000)
        if output_tokens:
            self.output_tokens.add(output_tokens)
            decode = timing.engine_inner - timing.engine_first_token
            if decode > 0:
                self.decode_rate.record(output_tokens / decode)
        self.timings.append(timing)

    def store_written(self, seconds: float, store: str) -> None:
        self.store_write_seconds.append(seconds)
        self.store_write.record(seconds * 1000, {"store": store})

    def socket_opened(self) -> None:
        self.open_sockets += 1
        self.connections.add(1)

    def socket_closed(self) -> None:
        self.open_sockets -= 1
        self.connections.add(-1)

    def recent_turns(self, last: int) -> list[dict[str, Any]]:
        n = max(1, min(last, len(self.timings) or 1))
        return [t.as_dict() for t in list(self.timings)[-n:]]

    def observe(self, name: str, callback, description: str = "", unit: str = "") -> None:
        """An observable gauge read at export time (cache bytes, engine queue depth)."""
        from opentelemetry.metrics import Observation

        def read(_options):
            return [Observation(v, attrs) for v, attrs in callback()]

        self._meter.create_observable_gauge(name, callbacks=[read], description=description, unit=unit)


__all__ = ["setup", "flush", "tracer", "inject", "extract", "extract_headers", "context_of", "hash_key", "ns_at", "span_between",
           "Metrics", "SpanKind", "StatusCode"]


@dataclass
class LoopHealth:
    """How long this process's event loop was held (its timer fired late) and how long Python's
    full garbage collections took: a replica's sockets all wait while either runs, so these explain
    a stall every client saw at once. Updated by `actors/loop_watch.py`."""

    lag_max_s: float = 0.0
    lags_over_100ms: int = 0
    lag_over_100ms_s: float = 0.0
    gc_full: int = 0
    gc_full_s: float = 0.0
    gc_full_max_s: float = 0.0
    stalls: list[str] = field(default_factory=list)  # the loop thread's stack in the last stalls over 1 s

    def snapshot(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}
