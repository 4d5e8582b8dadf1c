"""ScriptedEngine: deterministic outputs and tool calls at a configurable token rate.

A stand-in for a GPU engine in tests and benchmarks (named as such): it charges
prefill time only for prompt tokens it has not seen in the session (like an
engine with prefix caching) and decode time per output token.
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Optional

from cluster.config import ModelConfig, ScriptedEngineConfig
from cluster.config.renderers import renderer_of
from cluster.core.render.tokenizer import common_prefix
from cluster.engines.base import EngineDelta, EngineRequest, EngineStats, KvFacts
from cluster.engines.scripted.cost_model import PRESETS
from cluster.engines.scripted.kv_model import KvBlockPool
from cluster.engines.scripted.step_clock import StepClock


def example_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """Valid arguments for a JSON schema's required (else first) properties."""
    if not isinstance(parameters, dict):
        return {}
    props = parameters.get("properties") or {}
    if not isinstance(props, dict):
        return {}
    names = parameters.get("required") or list(props)[:1]
    args: dict[str, Any] = {}
    for name in names:
        spec = props.get(name) or {}
        kind = spec.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        if "enum" in spec and spec["enum"]:
            args[name] = spec["enum"][0]
        elif kind == "integer":
            args[name] = 1
        elif kind == "number":
            args[name] = 1.5
        elif kind == "boolean":
            args[name] = True
        elif kind == "array":
            item = (spec.get("items") or {}).get("type", "string")
            args[name] = [1] if item in ("integer", "number") else ["README.md"]
        elif kind == "object":
            args[name] = example_arguments(spec)
        else:
            args[name] = "README.md" if "path" in name or "file" in name else f"{name} value"
    return args


# The stand-in KV cache's capacity (a GPU holds a few million tokens of KV).
MAX_CACHED_SESSIONS = 4096
MAX_CACHED_TOKENS = 8_000_000


HEAD = 64  # tokens that name a prefix in the cross-session index


def _head(salt, tokens: array) -> tuple:
    return (salt, tokens[:HEAD].tobytes())


def written_calls(tool_parser: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as the family writes them (vLLM's parser for `tool_parser` reads them back)."""
    if tool_parser in ("qwen3_xml", "qwen3_coder"):  # Qwen3-Coder: XML
        return "\n".join("<tool_call>\n<function=%s>\n%s</function>\n</tool_call>" % (name, "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in args.items()))
            for name, args in calls)
    if tool_parser == "deepseek_v3":  # DeepSeek-V3 / R1: a ```json block a call, between the calls markers
        return "<｜tool▁calls▁begin｜>%s<｜tool▁calls▁end｜>" % "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```<｜tool▁call▁end｜>"
            for name, args in calls)
    if tool_parser == "llama3_json":  # Llama 3: the JSON object alone, calls joined by "; "
        return "; ".join(json.dumps({"name": name, "parameters": args}) for name, args in calls)
    return "\n".join('<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(args))
                     for name, args in calls)  # Hermes (Qwen2.5, Qwen3)


class ScriptedEngine:
    def __init__(
        self,
        model: ModelConfig,
        config: ScriptedEngineConfig,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        decode_raw: Optional[Callable[[list[int]], str]] = None,
    ) -> None:
        self.config = config
        self.max_model_len = model.max_model_len
        # A harmony model (gpt-oss) writes channels, not tags: its answers and calls are written so.
        self.harmony = renderer_of(model).output == "harmony"
        self.tool_parser = model.tool_parser  # how its calls are written (the family's format)
        self._encode, self._decode = encode, decode
        self._decode_raw = decode_raw or decode  # keeps special tokens: the template's turn markers
        # (cache salt, session) -> tokens in its "KV cache"; LRU, bounded like a real KV cache.
        self._seen: OrderedDict[tuple, array] = OrderedDict()
        self._seen_tokens = 0
        # Like vLLM's prefix cache, a prompt hits what *any* session of the same tenant
        # left behind: (salt, the first HEAD tokens) -> the session key that wrote them last.
        self._by_head: dict[tuple, tuple] = {}
        self._aborted: set[str] = set()
        self.stats = EngineStats()
        # A model of a real engine's step times (`preset`): its clock batches prefill and decode.
        self.clock = StepClock(PRESETS[config.preset]) if config.preset else None
        # The modelled KV cache (a stand-in for vLLM's block pool), when configured (a preset's by default).
        capacity = config.kv_capacity_tokens or (self.clock.model.kv_capacity_tokens if self.clock else None)
        self.kv: Optional[KvBlockPool] = (KvBlockPool(capacity, config.kv_block_size,
                                                      lower_tokens=config.kv_lower_tier_tokens or 0)
                                          if capacity else None)
        self.kv_capacity_tokens = self.kv.capacity_tokens if self.kv is not None else 0
        # What the KV budget weighs an ended retention by (None: no tier below, a re-prefill).
        self.lower_tier_tokens_per_s = (config.kv_lower_tier_tokens_per_second
                                        if self.kv is not None and self.kv.lower is not None else None)
        self.pins_off_reason = ""  # the modelled pool pins what the budget retains
        self._kv_freed = asyncio.Condition()
        self._compute = asyncio.Lock()  # serial_prefill: one prefill at a time

    async def start(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    def kv_facts(self) -> KvFacts:
        block = self.kv.block_size if self.kv is not None else 1
        return KvFacts(self.kv_capacity_tokens, block, self.lower_tier_tokens_per_s)

    def kv_in_use_tokens(self) -> Optional[int]:
        kv = self.kv
        return (kv.num_blocks - len(kv.free)) * kv.block_size if kv is not None else None

    def kv_stats(self) -> dict[str, Any]:
        return self.kv.stats() if self.kv is not None else {"preemptions": 0}

    def grammar_worker(self) -> Optional[dict[str, Any]]:
        return None

    async def shutdown(self) -> None:
        self._seen.clear()
        self._by_head.clear()
        self._seen_tokens = 0

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def script(self, request: EngineRequest) -> str:
        if self.config.answer_rules:
            prompt = self._decode(list(request.prompt_token_ids))
            for rule in self.config.answer_rules:
                if rule.contains in prompt:
                    return rule.text
        gen = request.generation
        offered = [t["function"] for t in gen.tools if t.get("type") == "function"]
        wants_tool = gen.tool_choice not in ("none",) and offered and (
            gen.tool_choice == "required" or isinstance(gen.tool_choice, dict)
            or self.last_turn(request.prompt_token_ids) == "user"
        )
        if wants_tool:
            fns = offered[:self.config.calls_per_turn] if gen.parallel_tool_calls else offered[:1]
            if isinstance(gen.tool_choice, dict) and gen.tool_choice.get("name"):
                fns = [next((f for f in offered if f["name"] == gen.tool_choice["name"]), fns[0])]
            calls = [(fn["name"], example_arguments(fn.get("parameters") or {})) for fn in fns]
            if self.harmony:
                return "".join(f"<|channel|>analysis<|message|>The user asked; {name} answers it.<|end|><|start|>"
                               f"assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                               f"{json.dumps(args)}<|call|>" for name, args in calls[:1])  # <|call|> ends the turn
            return self._think(f"The user asked; {calls[0][0]} answers it.") + written_calls(self.tool_parser, calls)
        if self.harmony:
            return (f"<|channel|>analysis<|message|>Time to answer.<|end|><|start|>assistant<|channel|>final<|message|>"
                    f"{self.config.answer_text}<|return|>")
        return self._think("Time to answer.") + self.config.answer_text

    def _think(self, reasoning: str) -> str:
        return f"<think>\n{reasoning}\n</think>\n\n" if self.config.thinks else ""

    def last_turn(self, prompt: array) -> str:
        """Who spoke last before the generation prompt: "user", "tool" or "other".

        Read from the prompt like a model would: the text between the chat template's
        last two turn markers. After a user message the scripted engine calls the first
        offered tool, after a tool result it answers (one call per user turn)."""
        marker, result = self.config.turn_marker, self.config.tool_result_marker
        if self.harmony:  # `<|start|>functions.x<|channel|>commentary to=assistant<|message|>...` is a tool's output
            marker, result = "<|start|>", "functions."
        n = 256
        while True:
            text = self._decode_raw(list(prompt[-n:]))
            if self.config.user_marker:  # whichever came last, a user message or a tool result
                user, tool = text.rfind(self.config.user_marker), text.rfind(result)
                if user >= 0 or tool >= 0 or n >= len(prompt):
                    return "tool" if tool > user else "user" if user >= 0 else "other"
                n *= 4
                continue
            last = text.rfind(marker)
            before = text.rfind(marker, 0, last) if last > 0 else -1
            if before >= 0 or n >= len(prompt):
                message = text[before + len(marker):last] if before >= 0 else text[:max(last, 0)]
                if message.startswith(result) if self.harmony else result in message:
                    return "tool"
                return "user" if message.startswith(("user", "system", "developer")) else "other"
            n *= 4

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if self.kv is not None:
            async for delta in self._generate_modelled(request):
                yield delta
            return
        stats = self.stats
        stats.requests += 1
        stats.sessions.add(request.session_key)
        prompt = request.prompt_token_ids
        n_prompt = len(prompt) + request.image_tokens  # as a vision engine counts it: images expanded
        key = (request.cache_salt, request.session_key)
        cached = common_prefix(self._seen.get(key, array("i")), prompt)
        other = self._by_head.get(_head(request.cache_salt, prompt))
        if other is not None and other != key and other in self._seen:
            # a stateless client (a new session key per request) still hits the prefix it sent before
            cached = max(cached, common_prefix(self._seen[other], prompt))
        # Like a block-based prefix cache: the last prompt token is always computed.
        cached = min(cached, max(len(prompt) - 1, 0))
        stats.prompt_tokens += n_prompt
        stats.cached_tokens += cached
        prefill = (len(prompt) - cached) / self.config.prefill_tokens_per_second
        if prefill > 0:
            await asyncio.sleep(prefill)
        out_ids = self._encode(self.script(request))[: min(request.generation.max_tokens, self.config.max_output_tokens)]
        finish = "stop" if len(out_ids) == len(self._encode(self.script(request))) else "length"
        per_token = 1.0 / self.config.tokens_per_second
        start = time.perf_counter()
        emitted: list[int] = []
        try:
            for i, tok in enumerate(out_ids):
                if request.request_id in self._aborted:
                    stats.aborted += 1
                    yield EngineDelta(finished=True, finish_reason="abort", prompt_tokens=n_prompt,
                                      cached_tokens=cached)
                    return
                # Sleep to the schedule, not per token (sleep granularity ~1 ms).
                lag = start + (i + 1) * per_token - time.perf_counter()
                if lag > 0.001:
                    await asyncio.sleep(lag)
                prev = self._decode(emitted)
                emitted.append(tok)
                stats.output_tokens += 1
                stats.pieces += 1
                last = i == len(out_ids) - 1
                yield EngineDelta(
                    text=self._decode(emitted)[len(prev) :],
                    new_tokens=1,
                    finished=last,
                    finish_reason=finish if last else None,
                    prompt_tokens=n_prompt,
                    cached_tokens=cached,
                    token_ids=[tok],
                )
            if not out_ids:
                yield EngineDelta(finished=True, finish_reason="length", prompt_tokens=n_prompt, cached_tokens=cached)
        except (asyncio.CancelledError, GeneratorExit):
            stats.aborted += 1
            raise
        finally:
            self._aborted.discard(request.request_id)
            self._remember(key, prompt + array("i", emitted))

    def _remember(self, key: tuple, tokens: array) -> None:
        old = self._seen.pop(key, None)
        self._seen_tokens += len(tokens) - (len(old) if old is not None else 0)
        self._seen[key] = tokens
        self._by_head[_head(key[0], tokens)] = key
        while len(self._seen) > 1 and (len(self._seen) > MAX_CACHED_SESSIONS or self._seen_tokens > MAX_CACHED_TOKENS):
            dropped_key, dropped = self._seen.popitem(last=False)
            self._seen_tokens -= len(dropped)
            head = _head(dropped_key[0], dropped)
            if self._by_head.get(head) == dropped_key:
                del self._by_head[head]

    # -- with the modelled KV cache ------------------------------------------------------

    async def _admit(self, request_id: str, salt: Optional[str], tokens: array) -> tuple[int, int]:
        """Wait (like vLLM's waiting queue) until the request's blocks fit; its cached tokens, and
        how many of those come from the lower tier."""
        async with self._kv_freed:
            while True:
                cached = self.kv.allocate(request_id, salt, tokens)
                if cached is not None:
                    return min(cached, max(len(tokens) - 1, 0)), self.kv.last_loaded_tokens
                await self._kv_freed.wait()

    async def _freed(self) -> None:
        async with self._kv_freed:
            self._kv_freed.notify_all()

    async def _generate_modelled(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        stats, kv, rid = self.stats, self.kv, request.request_id
        stats.requests += 1
        stats.sessions.add(request.session_key)
        for pin in request.kv_unpin:
            kv.unpin(pin)
        prompt = request.prompt_token_ids
        n_prompt = len(prompt) + request.image_tokens  # as a vision engine counts it: images expanded
        script = self._encode(self.script(request))
        out_ids = script[: min(request.generation.max_tokens, self.config.max_output_tokens)]
        finish = "stop" if len(out_ids) == len(script) else "length"
        per_token = 1.0 / self.config.tokens_per_second
        emitted: list[int] = []
        reported: Optional[int] = None  # the first scheduling's hit is what the request reports
        try:
            while True:
                tokens = prompt + array("i", emitted)
                cached, loaded = await self._admit(rid, request.cache_salt, tokens)
                if reported is None:
                    reported = cached
                    stats.prompt_tokens += n_prompt
                    stats.cached_tokens += cached
                if loaded:  # a copy up from host memory: no compute, the tier's transfer rate
                    await asyncio.sleep(loaded / self.config.kv_lower_tier_tokens_per_second)
                prefill = (len(tokens) - cached) / self.config.prefill_tokens_per_second
                if self.clock is not None:
                    await self.clock.prefill(len(tokens) - cached, cached)
                    self.clock.start_decode(rid, len(tokens), len(out_ids) - len(emitted))
                elif prefill > 0 and self.config.serial_prefill:
                    async with self._compute:
                        await asyncio.sleep(prefill)
                elif prefill > 0:
                    await asyncio.sleep(prefill)
                preempted = False
                start = time.perf_counter()
                for i in range(len(emitted), len(out_ids)):
                    if rid in self._aborted:
                        stats.aborted += 1
                        yield EngineDelta(finished=True, finish_reason="abort", prompt_tokens=n_prompt,
                                          cached_tokens=reported)
                        return
                    if not kv.is_running(rid):  # preempted by another request's growth
                        preempted = True
                        break
                    while not kv.grow(rid, len(prompt) + i + 1):
                        victim = kv.preempt_newest()
                        if victim == rid or victim is None:
                            preempted = True
                            break
                        await self._freed()
                    if preempted:
                        break
                    lag = start + (i - len(emitted) + 1) * per_token - time.perf_counter()
                    if self.clock is not None:
                        await self.clock.next_token(rid)
                    elif lag > 0.001:
                        await asyncio.sleep(lag)
                    prev = self._decode(emitted)
                    emitted.append(out_ids[i])
                    stats.output_tokens += 1
                    stats.pieces += 1
                    last = i == len(out_ids) - 1
                    yield EngineDelta(text=self._decode(emitted)[len(prev):], new_tokens=1, finished=last,
                                      finish_reason=finish if last else None, prompt_tokens=n_prompt,
                                      cached_tokens=reported, token_ids=[out_ids[i]])
                if preempted:
                    if self.clock is not None:
                        self.clock.stop(rid)
                    await self._freed()
                    continue  # recomputed: back to the waiting queue
                if not out_ids:
                    yield EngineDelta(finished=True, finish_reason="length", prompt_tokens=n_prompt,
                                      cached_tokens=reported)
                return
        except (asyncio.CancelledError, GeneratorExit):
            stats.aborted += 1
            raise
        finally:
            self._aborted.discard(rid)
            if self.clock is not None:
                self.clock.stop(rid)
            if kv.is_running(rid):
                kv.finish(rid, prompt + array("i", emitted), pin=request.kv_pin if request.kv_ttl_s > 0 else "")
            # Blocks went back to the pool: requests waiting for room may fit now.
            asyncio.get_running_loop().create_task(self._freed())
