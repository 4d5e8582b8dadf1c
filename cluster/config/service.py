"""The connection replicas' service: WebSocket mode, limits, caches, safety, post-work, store, telemetry."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator

from cluster.config.base import StrictModel
from cluster.config.deployments import DeploymentResources
from cluster.config.engine import EngineConfig, ModelConfig


class WebSocketConfig(StrictModel):
    max_connection_seconds: float = 3600.0
    # A socket with no frame and no turn in flight for this long is closed
    # (error event + close 1000), freeing its cache.
    idle_timeout_seconds: float = Field(900.0, gt=0)
    # Browser clients: when set, an upgrade whose Origin header is not listed is
    # refused (403). Requests without an Origin (SDKs, CLIs) are not affected.
    allowed_origins: list[str] = Field(default_factory=list)
    # Frames above this get an error event (the proxy itself closes above 16 MiB).
    max_frame_bytes: int = 15 * 1024 * 1024
    max_queued_creates: int = 64
    # Bytes of frames waiting behind the response in flight on one socket.
    max_queued_bytes: int = 32 * 1024 * 1024
    # A multi-agent response (beta) waits this long for `response.inject` to answer its tool
    # calls; then it ends as it stands (completed, the calls left for a normal continuation).
    agent_wait_seconds: float = Field(300.0, gt=0)


class OpsConfig(StrictModel):
    """Routes for operators and benchmarks, off the public API."""

    # `/loopserve/echo`: a WebSocket echo through the same ingress, the latency
    # floor the benchmark compares with. Benchmark-only: off unless turned on,
    # and even then it needs an admin key and obeys the WebSocket limits.
    echo_route: bool = False
    # Tests and debugging: engine replicas also keep a digest of each prompt's text (decoded,
    # O(prompt) after each turn), to check prompts that reuse generated tokens against a full
    # render (their token ids legitimately differ from a re-tokenization).
    prompt_text_digests: bool = False


class LimitsConfig(StrictModel):
    """Bounds on what one request may ask for (each answered with a 4xx in the API's shape)."""

    max_input_items: int = Field(10_000, ge=1)  # items in one request's `input`
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)  # HTTP body
    # Prompt tokens of a turn's whole context (history + new input); default:
    # the model's max_model_len.
    max_context_tokens: Optional[int] = Field(None, ge=1)
    # Payload bytes one conversation's state may keep in memory (all items, rendered
    # or not): what a single chain can pin in a replica's caches.
    max_context_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # `background: true` responses running at once on one replica (429 beyond).
    max_background: int = Field(256, ge=1)


class CacheConfig(StrictModel):
    # Per WebSocket connection.
    max_entries: int = 64
    max_bytes: int = 256 * 1024 * 1024
    # All connections' caches on one replica together: past this, the caches of
    # the least recently used connections are emptied (their next continuation
    # is `previous_response_not_found` with `store: false`, or a store load).
    connections_max_bytes: int = 2 * 1024 * 1024 * 1024
    # Replica-wide cache of `store: true` responses, for HTTP continuations.
    replica_max_entries: int = 4096
    replica_max_bytes: int = 1024 * 1024 * 1024


class GuardConfig(StrictModel):
    """A Llama Guard-style model served by its own engine deployment."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    deployment: DeploymentResources = Field(default_factory=lambda: DeploymentResources(num_cpus=0.5))
    max_tokens: int = 10
    # A guard answer that is neither `safe` nor `unsafe ...` (a wrong model, a
    # truncated answer) is logged and counted; this decides the verdict.
    on_unparseable: Literal["flag", "allow"] = "flag"


class SafetyConfig(StrictModel):
    """Input/output classification by the SafetyActor.

    `default`: the scikit-learn profanity model shipped in `alt-profanity-check`
    plus the `policy` patterns; `policy`: the patterns only; `guard`: a Llama
    Guard-style model on the engine tier (plus the patterns).
    """

    enabled: bool = True
    classifier: Literal["default", "policy", "guard"] = "default"
    profanity_threshold: float = Field(0.9, ge=0, le=1)
    # category -> regular expressions (case-insensitive); a match flags the text.
    policy: dict[str, list[str]] = Field(default_factory=dict)
    # Tool outputs are the client's own data (files, command output): not
    # classified unless asked, to keep false positives out of agent loops.
    classify_tool_outputs: bool = False
    output_chunk_chars: int = Field(256, ge=16)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    # Where the `default`/`policy` classifiers run: `inline` in the connection replica
    # (~0.1 ms a check; no handle hop before the first token) or `actor` (the
    # SafetyActor deployment, scaled on its own). A `guard` always runs as an actor.
    placement: Literal["inline", "actor"] = "inline"
    deployment: DeploymentResources = Field(default_factory=lambda: DeploymentResources(num_cpus=0.1))

    @property
    def runs_inline(self) -> bool:
        return self.enabled and self.placement == "inline" and self.classifier != "guard"

    @model_validator(mode="after")
    def _guard_has_a_model(self) -> "SafetyConfig":
        g = self.guard
        if self.enabled and self.classifier == "guard" and g.engine.backend == "vllm" and g.model.path is None:
            raise ValueError("safety.classifier 'guard' needs safety.guard.model.path (a Llama Guard-style "
                             "model); the generated tiny model has random weights and cannot judge anything")
        return self


class PostWorkConfig(StrictModel):
    retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.2, ge=0)
    # Extra hooks: "package.module:factory"; factory(config) -> async hook(TurnRecord).
    hooks: list[str] = Field(default_factory=list)


class StoreConfig(StrictModel):
    """Where `store: true` responses live beyond memory."""

    backend: Literal["sqlite", "postgres", "none"] = "sqlite"
    sqlite_path: str = str(Path.home() / ".cache" / "loopserve" / "responses.sqlite3")
    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    # The name of an environment variable holding the DSN instead (a Kubernetes Secret's
    # `secretKeyRef`): the password never sits in the config. Read where the store opens.
    postgres_dsn_env: Optional[str] = None
    # Writes are post-inference work: a failed write is retried with backoff
    # for this long (the store restarting, a failover), then counted in
    # `/loopserve/stats` (`store_writes.failed`) and logged with the response
    # id; the response stays readable and continuable from this replica's memory.
    write_retry_s: float = Field(60.0, ge=0)


class TelemetryConfig(StrictModel):
    """OpenTelemetry export (off by default: no-op tracer and meter, nothing exported)."""

    enabled: bool = False
    # OTLP over gRPC (collector port 4317) or HTTP/protobuf (port 4318).
    protocol: Literal["grpc", "http"] = "grpc"
    endpoint: str = "http://127.0.0.1:4317"
    insecure: bool = True  # gRPC without TLS (a collector beside the cluster)
    service_name: str = "loopserve"
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)  # of root spans; children follow their parent
    # A client's `traceparent` joins its trace either way; its sampled flag decides only when this
    # is true (clients you run yourselves). Otherwise the server samples at `sample_ratio`.
    honor_client_sampling: bool = False
    export_delay_ms: int = Field(1000, ge=10)
    metrics_interval_ms: int = Field(10000, ge=100)
