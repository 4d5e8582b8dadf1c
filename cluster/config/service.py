"""The connection replicas' service: WebSocket mode, limits, caches, safety, post-work, store, telemetry."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator

from cluster.config.backends import backend_of
from cluster.config.base import StrictModel
from cluster.config.deployments import DeploymentResources
from cluster.config.engine import EngineConfig, ModelConfig


class WebSocketConfig(StrictModel):
    """WebSocket mode (`/v1/responses` upgraded): what one socket may hold and how long it lives."""

    max_connection_seconds: float = 3600.0
    """A socket's life: then it is told to reconnect (`websocket_connection_limit_reached`) after its turn in flight."""
    idle_timeout_seconds: float = Field(900.0, gt=0)
    """A socket with no frame and no turn in flight for this long is closed (error event + close 1000), freeing its
    cache."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Browser clients: when set, a request or upgrade whose Origin header is not listed is refused (403). Unset, a
    server without API keys admits only pages served from localhost (any page its user visits could drive it
    otherwise); with keys, any Origin. Requests without an Origin (SDKs, CLIs) are not affected."""
    max_frame_bytes: int = 15 * 1024 * 1024
    """Frames above this get an error event (the proxy itself closes above 16 MiB)."""
    max_frame_bytes_per_minute: int = Field(48 * 1024 * 1024, ge=1024 * 1024)
    """Bytes of frames one socket may send a minute, every type (a token bucket), charged before a frame is read
    (and to its key's `input_bytes_per_minute` as well, which bounds a key's sockets together): reading a frame
    holds the replica's event loop by the byte, up to ~64 ms a MiB for the worst shapes. Past it a frame is
    dropped with a 429, and a client that keeps sending spends its error budget and is closed."""
    max_queued_creates: int = 64
    """Creates and unread errors one socket may have waiting; more are refused at once (429)."""
    max_queued_bytes: int = 32 * 1024 * 1024
    """Bytes creates waiting behind the responses in flight on one socket hold, parsed (a frame of small items
    holds ~10x its size once parsed)."""
    max_error_bytes_per_minute: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    """Bytes of errors and failed steers/injects (which return their input) the server may send one socket a
    minute (a token bucket); past it the socket is closed (1008 `too_many_errors`). Holds whether the ingress
    applies back-pressure or not (Serve's Python proxy does not)."""
    max_replica_held_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024)
    """Steering input and injected tool outputs held on all sockets of one connection replica together (each
    socket: 4 MiB and 16 MiB); past it a steer fails (`too_many_pending_steers`) and an inject is refused
    (`inject_limit_reached`)."""
    max_replica_queued_bytes: int = Field(512 * 1024 * 1024, ge=1024 * 1024)
    """The same, summed over every socket of one connection replica: past it a create is refused at once (429),
    whatever socket it came on."""
    agent_wait_seconds: float = Field(300.0, gt=0)
    """A multi-agent response (beta) waits this long for `response.inject` to answer its tool calls; then it ends
    as it stands (completed, the calls left for a normal continuation)."""


class OpsConfig(StrictModel):
    """Routes for operators and benchmarks, off the public API."""

    echo_route: bool = False
    """`/loopserve/echo`: a WebSocket echo through the same ingress, the latency floor the benchmark compares with.
    Benchmark-only: off unless turned on, and even then it needs an admin key and obeys the WebSocket limits."""
    prompt_text_digests: bool = False
    """Tests and debugging: engine replicas also keep a digest of each prompt's text (decoded, O(prompt) after each
    turn), to check prompts that reuse generated tokens against a full render (their token ids legitimately
    differ from a re-tokenization)."""


class LimitsConfig(StrictModel):
    """Bounds on what one request may ask for (each answered with a 4xx in the API's shape)."""

    max_input_items: int = Field(10_000, ge=1)
    """Items in one request's `input`."""
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Bytes of an HTTP request body."""
    max_context_tokens: Optional[int] = Field(None, ge=1)
    """Prompt tokens of a turn's whole context (history + new input); default: the model's max_model_len."""
    max_context_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Payload bytes one conversation's state may keep in memory (all items, rendered or not): what a single chain
    can pin in a replica's caches."""
    max_background: int = Field(256, ge=1)
    """`background: true` responses running at once on one replica (429 beyond)."""
    max_background_per_tenant: int = Field(64, ge=1)
    """Of those, what one tenant may have running (429 beyond): one key cannot take every slot."""
    shared_across_replicas: Optional[bool] = None
    """Keys' limits (`requests_per_minute`, `reads_per_minute`, `max_connections`) hold for the whole app, not
    per connection replica: each replica reports what it admitted to one `LimitsAndVerdicts` replica about once a
    second and counts what the others hold (a key may overshoot by what the others admitted in that second).
    None: on when the connection deployment can run more than one replica (`num_replicas` > 1, `auto`, or
    autoscaling); false: each replica enforces them alone (they multiply with the replicas)."""


class CacheConfig(StrictModel):
    """Response state kept in memory for continuations (`previous_response_id`): per socket and replica-wide."""

    max_entries: int = 64
    """Per WebSocket connection."""
    max_bytes: int = 256 * 1024 * 1024
    """Per WebSocket connection, in bytes of response state."""
    connections_max_bytes: int = 2 * 1024 * 1024 * 1024
    """All connections' caches on one replica together: past this, the caches of the least recently used
    connections are emptied (their next continuation is `previous_response_not_found` with `store: false`, or a
    store load)."""
    replica_max_entries: int = 4096
    """Replica-wide cache of `store: true` responses, for HTTP continuations."""
    replica_max_bytes: int = 1024 * 1024 * 1024
    """The replica-wide cache of `store: true` responses, in bytes."""


class GuardConfig(StrictModel):
    """A Llama Guard-style model served by its own engine deployment."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The guard model's own engine."""
    deployment: DeploymentResources = Field(default_factory=lambda: DeploymentResources(ray_actor_options={"num_cpus": 0.5}))
    """The guard engine's replicas."""
    max_tokens: int = 10
    """Output tokens the guard model may use for a verdict."""
    on_unparseable: Literal["flag", "allow"] = "flag"
    """A guard answer that is neither `safe` nor `unsafe ...` (a wrong model, a truncated answer) is logged and
    counted; this decides the verdict."""


class SafetyConfig(StrictModel):
    """Input/output classification by the SafetyActor.

    `default`: the scikit-learn profanity model shipped in `alt-profanity-check`
    plus the `policy` patterns; `policy`: the patterns only; `guard`: a Llama
    Guard-style model on the engine tier (plus the patterns).
    """

    enabled: bool = True
    """Classify input before it reaches the model and output before it reaches the client."""
    classifier: Literal["default", "policy", "guard"] = "default"
    """`default` (profanity model + policy patterns), `policy` (patterns only) or `guard` (a guard model)."""
    profanity_threshold: float = Field(0.9, ge=0, le=1)
    """The profanity model's score at which a text is flagged."""
    policy: dict[str, list[str]] = Field(default_factory=dict)
    """Category -> regular expressions (case-insensitive); a match flags the text."""
    classify_tool_outputs: bool = False
    """Tool outputs are the client's own data (files, command output): not classified unless asked, to keep false
    positives out of agent loops."""
    output_chunk_chars: int = Field(256, ge=16)
    """Generated text is classified in chunks of this many characters, before the client sees them."""
    max_unverified_chars: Optional[int] = Field(None, ge=16)
    """The most generated characters a client may hold before the classifier's verdict on them (a flagged answer
    is cut within this many characters of the flagged chunk's start, however large the engine's pieces and however
    late the verdicts). Default: two chunks; never below one chunk."""
    guard: GuardConfig = Field(default_factory=GuardConfig)
    placement: Literal["inline", "actor"] = "inline"
    """Where the `default`/`policy` classifiers run: `inline` in the connection replica (~0.1 ms a check; no handle
    hop before the first token) or `actor` (the SafetyActor deployment, scaled on its own). A `guard` always
    runs as an actor."""
    deployment: DeploymentResources = Field(default_factory=lambda: DeploymentResources(ray_actor_options={"num_cpus": 0.1}))
    """The SafetyActor replicas (with `placement: actor`, or a guard)."""

    @property
    def runs_inline(self) -> bool:
        return self.enabled and self.placement == "inline" and self.classifier != "guard"

    @model_validator(mode="after")
    def _guard_has_a_model(self) -> "SafetyConfig":
        g = self.guard
        if self.enabled and self.classifier == "guard" and backend_of(g.engine).runs_weights and g.model.path is None:
            raise ValueError("safety.classifier 'guard' needs safety.guard.model.path (a Llama Guard-style "
                             "model); the generated tiny model has random weights and cannot judge anything")
        return self


class PostWorkConfig(StrictModel):
    """Work after a response ends (store writes, usage, output tail checks): retried, never in the turn's way."""

    retries: int = Field(3, ge=0)
    """Attempts of a post-inference hook after its first failure."""
    backoff_s: float = Field(0.2, ge=0)
    """First backoff between attempts (doubling)."""
    hooks: list[str] = Field(default_factory=list)
    """Extra hooks: "package.module:factory"; factory(config) -> async hook(TurnRecord)."""


class StoreConfig(StrictModel):
    """Where `store: true` responses live beyond memory."""

    backend: Literal["sqlite", "postgres", "none"] = "sqlite"
    """`sqlite`, `postgres`, or `none` (responses live in replica memory only)."""
    sqlite_path: str = str(Path.home() / ".cache" / "loopserve" / "responses.sqlite3")
    """The SQLite file (one per node)."""
    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    """The PostgreSQL DSN (prefer `postgres_dsn_env` where the DSN holds a password)."""
    postgres_dsn_env: Optional[str] = None
    """The name of an environment variable holding the DSN instead (a Kubernetes Secret's `secretKeyRef`): the
    password never sits in the config. Read where the store opens."""
    write_retry_s: float = Field(60.0, ge=0)
    """Writes are post-inference work: a failed write is retried with backoff for this long (the store restarting,
    a failover), then counted in `/loopserve/stats` (`store_writes.failed`) and logged with the response id; the
    response stays readable and continuable from this replica's memory."""


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
