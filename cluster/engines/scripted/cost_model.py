"""What one step of a continuous-batching engine costs, as a roofline: the scripted engine's
clock when `engine.scripted.preset` names a model of a real engine (the KV policy is judged
against it at GPU speed, not only at this CPU's).

A step runs every running request's next decode token and, within `max_batched_tokens`, chunks
of waiting prefills (vLLM's chunked prefill: prefill shares steps with decode). Its time is

    overhead + max(compute / flops, memory / bandwidth)

- compute: 2 x parameters FLOPs a token (the linear layers), plus attention, 4 x layers x
  attention width FLOPs per token for every token it attends to (its context): prefill cost
  grows with the context it extends, quadratically over a long prompt;
- memory: the weights read once a step, plus every token's KV the step's tokens attend to
  (decode at a large batch and long contexts is bound by reading KV, not weights).

Calibration (docs/benchmarks.md, "The engine model"): `h100-8b` is Llama-3.1-8B in bf16 on one
H100 SXM (989 dense bf16 TFLOP/s, 3.35 TB/s HBM3) at the efficiencies that reproduce published
vLLM numbers; `cpu` is SmolLM2-135M in float32 on this machine's 2 cores, from vLLM 0.32's CPU
engine measured here. Plain logic: no clock, no tasks (`scripted/step_clock.py` runs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class EngineCostModel:
    name: str
    params: float  # parameters: 2 x this FLOPs a token in the linear layers
    layers: int
    attention_width: int  # query heads x head dim: 4 x layers x this FLOPs a token per token attended
    kv_bytes_per_token: int
    weight_bytes: float
    flops: float  # achieved FLOP/s (peak x the efficiency a real engine reaches)
    bandwidth: float  # achieved bytes/s
    step_overhead_s: float  # scheduling, sampling, launch: what even an empty batch costs a step
    max_batched_tokens: int  # tokens one step takes (decode first, then prefill chunks)
    kv_capacity_tokens: int  # one replica's KV pool
    compute_bound: bool = False  # prefills share one compute unit and wait for each other (a CPU)
    attention_flops: float = 0.0  # achieved FLOP/s in attention (0: `flops`; a CPU's attention kernels reach less)
    kv_bandwidth: float = 0.0  # achieved bytes/s reading KV (0: `bandwidth`; a CPU's scattered blocks read slower)
    overlapped: bool = True  # compute and memory traffic overlap (a GPU: the longer of them); else they add up
    max_model_len: int = 131_072  # the named model's context (Llama-3.1-8B: 128k)

    def step_time(self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]] = ()) -> float:
        """Seconds for one step: a decode token for each context in `decode_contexts` (tokens before
        it), and each prefill chunk (tokens, context before the chunk)."""
        if not decode_contexts and not prefill_chunks:
            return 0.0
        pair = 4.0 * self.layers * self.attention_width
        tokens = len(decode_contexts) + sum(n for n, _ in prefill_chunks)
        attended = sum(decode_contexts) + sum(n * c + n * (n + 1) / 2 for n, c in prefill_chunks)
        compute = 2.0 * self.params * tokens / self.flops + pair * attended / (self.attention_flops or self.flops)
        kv_read = sum(decode_contexts) + sum(c + n for n, c in prefill_chunks)
        kv_bandwidth = self.kv_bandwidth or self.bandwidth
        memory = self.weight_bytes / self.bandwidth + self.kv_bytes_per_token * kv_read / kv_bandwidth
        return self.step_overhead_s + (max(compute, memory) if self.overlapped else compute + memory)

    def prefill_time(self, tokens: int, context: int = 0) -> float:
        """A prefill of `tokens` after `context` cached tokens, alone on the engine, in chunks."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(self.max_batched_tokens, tokens - done)
            total += self.step_time((), ((n, context + done),))
            done += n
        return total

    def decode_step(self, batch: int, context: int) -> float:
        """One decode step of `batch` requests of `context` tokens each."""
        return self.step_time([context] * batch)

    def lower_bound(self, prefill: Sequence[tuple[int, int]], decode: Sequence[tuple[int, int]],
                    concurrency: int) -> float:
        """The least time a workload takes: its necessary prefills (tokens, context) at full chunks
        and its decode tokens (tokens, context) at `concurrency` requests a step, steps back to back."""
        total = sum(self.prefill_time(n, c) for n, c in prefill)
        tokens = sum(n for n, _ in decode)
        if tokens:
            context = sum(n * c for n, c in decode) / tokens
            batch = max(1, min(concurrency, tokens))
            total += tokens / batch * self.decode_step(batch, int(context))
        return total


def _llama_8b_h100(name: str, kv_capacity_tokens: int) -> EngineCostModel:
    # Llama-3.1-8B: 8.03B parameters, 32 layers, 32 query heads x 128, 8 KV heads x 128, bf16:
    # 2 (K, V) x 32 x 8 x 128 x 2 bytes = 128 KiB of KV a token. H100 SXM at 50% of its dense bf16
    # peak and 80% of its bandwidth; 2 ms a step beyond the roofline (a batch of 8 decoding after 32
    # tokens on an H200, 4.8 TB/s: 6.5 ms a step in vLLM's nightly latency test; here 6.2 ms).
    return EngineCostModel(name=name, params=8.03e9, layers=32, attention_width=4096, kv_bytes_per_token=131_072,
                           weight_bytes=16.06e9, flops=0.5 * 989e12, bandwidth=0.8 * 3.35e12, step_overhead_s=0.002,
                           max_batched_tokens=8192, kv_capacity_tokens=kv_capacity_tokens)


PRESETS: dict[str, EngineCostModel] = {
    # 80 GB less 16 GB of weights and activations at 0.9 utilization: ~55 GB of KV, ~420k tokens.
    "h100-8b": _llama_8b_h100("h100-8b", 420_000),
    # The same engine for contexts of 30-120k tokens (the KV pool holds 3 to 14 sessions of them).
    "h100-8b-long": _llama_8b_h100("h100-8b-long", 420_000),
    # SmolLM2-135M in float32 on this machine's vLLM 0.32 CPU engine (2 cores, VLLM_CPU_KVCACHE_SPACE=2:
    # 46,592 tokens): 30 layers, 9 query heads x 64, 3 KV heads x 64 (45 KiB of KV a token in fp32).
    # Fitted to what that engine measured here (docs/benchmarks.md): 512 tokens prefilled after 0 / 2k
    # / 4k / 7k cached in 706 / 1,147 / 1,596 / 2,192 ms; a decode step of 1 / 8 requests at 64 tokens
    # 39 / 44 ms, of 1 / 8 at 4k 48 / 196 ms. Compute and memory add up; prefills share the cores.
    "cpu": EngineCostModel(name="cpu", params=1.345e8, layers=30, attention_width=576, kv_bytes_per_token=46_080,
                           weight_bytes=5.38e8, flops=2.2e11, bandwidth=3.0e10, step_overhead_s=0.020,
                           max_batched_tokens=4096, kv_capacity_tokens=46_592, compute_bound=True,
                           attention_flops=1.7e11, kv_bandwidth=1.4e10, overlapped=False, max_model_len=8192),
}
