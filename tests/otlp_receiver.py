"""Small OTLP receivers on 127.0.0.1 for tests (no collector binary installs here).

`OtlpHttpReceiver`: OTLP/HTTP protobuf, `POST /v1/traces` and `/v1/metrics`.
`OtlpGrpcReceiver`: OTLP/gRPC trace service. Both decode with the
`opentelemetry-proto` messages the exporters encode with, and keep what they
received as plain dicts.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_of(req: ExportTraceServiceRequest) -> list[dict[str, Any]]:
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent_id": s.parent_span_id.hex(), "attributes": _attrs(s.attributes),
                            "resource": resource, "start": s.start_time_unix_nano, "end": s.end_time_unix_nano})
    return out


def metrics_of(req: ExportMetricsServiceRequest) -> list[dict[str, Any]]:
    out = []
    for rm in req.resource_metrics:
        resource = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    value = p.count if kind in ("histogram", "exponential_histogram") else _value_of_number(p)
                    out.append({"name": m.name, "kind": kind, "value": value, "attributes": _attrs(p.attributes),
                                "resource": resource})
    return out


def _value_of_number(p) -> float:
    return p.as_double if p.WhichOneof("value") == "as_double" else p.as_int


class _Collected:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def wait_for(self, predicate: Callable[["_Collected"], bool], timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                if predicate(self):
                    return True
            time.sleep(0.2)
        return False


class OtlpHttpReceiver(_Collected):
    def __init__(self) -> None:
        super().__init__()
        collected = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces":
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    with collected.lock:
                        collected.spans += spans_of(req)
                elif self.path == "/v1/metrics":
                    req = ExportMetricsServiceRequest()
                    req.ParseFromString(body)
                    with collected.lock:
                        collected.metrics += metrics_of(req)
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "OtlpHttpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class OtlpGrpcReceiver(_Collected):
    """`tls`: (key PEM, certificate PEM) to serve over TLS (the url is then https://localhost:port)."""

    def __init__(self, tls: "tuple[bytes, bytes] | None" = None) -> None:
        super().__init__()
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        collected = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (gRPC's naming)
                with collected.lock:
                    collected.spans += spans_of(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self.server)
        if tls is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
            self.url = f"http://127.0.0.1:{port}"
        else:
            port = self.server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([tls]))
            self.url = f"https://localhost:{port}"

    def __enter__(self) -> "OtlpGrpcReceiver":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)
