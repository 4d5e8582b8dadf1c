"""`telemetry`: OpenTelemetry export."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from cluster.config.base import StrictModel


class TelemetryConfig(StrictModel):
    """OpenTelemetry export (off by default: no-op tracer and meter, nothing exported)."""

    enabled: bool = False
    """Export traces and metrics over OTLP."""
    protocol: Literal["grpc", "http"] = "grpc"
    """OTLP over gRPC (collector port 4317) or HTTP/protobuf (port 4318)."""
    endpoint: str = "http://127.0.0.1:4317"
    """The collector's OTLP endpoint."""
    insecure: bool = True
    """gRPC without TLS (a collector beside the cluster). Ignored when `ca_file` is set."""
    ca_file: Optional[str] = None
    """PEM of the CA that signed the collector's certificate: export over TLS, the collector verified (grpc and
    http; an `https://` endpoint)."""
    service_name: str = "loopserve"
    """`service.name` of the exported resource."""
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Share of root spans sampled; children follow their parent."""
    honor_client_sampling: bool = False
    """A client's `traceparent` joins its trace either way; its sampled flag decides only when this is true
    (clients you run yourselves). Otherwise the server samples at `sample_ratio`."""
    export_delay_ms: int = Field(1000, ge=10)
    """Longest wait before a batch of spans is exported."""
    metrics_interval_ms: int = Field(10000, ge=100)
    """How often metrics are exported."""

