"""The served model's tokenizer and chat template, wired into the core renderer; and what a
prompt costs at least, known before the tokenizer runs.

HF tokenizers render with their Jinja chat template (text, then tokenized);
Mistral models served with vLLM's `tokenizer_mode="mistral"` render with
mistral_common through vLLM's `MistralTokenizer` (token ids directly).

A token covers at most `max_token_chars` characters (the tokenizer's longest vocabulary entry,
added tokens included), so text of n characters is at least n / max_token_chars tokens. The text
counted is what every chat template renders as it is: the content of user, system and developer
messages and the output of tool calls, each part stripped (templates may trim). An input whose
floor is over the model's context is refused without tokenizing it: tokenizing holds the GIL
(~0.65 s per MB here), so a client sending multi-megabyte inputs would otherwise stall the
replica's event loop (and its health checks) only to learn the same answer.

A user message costs at least `min_user_message_tokens` on top of its text: the role markers
its template writes around it, measured once from the template (one more user message, empty
and not, after another). 10,000 one-character messages are 300 KB and ~50,000 tokens: refused
here, not after a render of all of them. A template that writes nothing for some message
measures 0, and the floor is its text alone.
"""

from __future__ import annotations

import importlib
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from cluster.config import LoopserveConfig, ModelConfig
from cluster.config.backends import backend_of
from cluster.config.renderers import RENDERERS, renderer_of
from cluster.core.render.images import (
    ImageTokens,
    load_processor,
    processor_image_tokens,
)
from cluster.core.render.chat_messages import ContentGuard
from cluster.core.render.probe import ProbeReport, format_step
from cluster.core.render.probe import probe as probe_renderer
from cluster.core.render.renderer import IncrementalRenderer, TemplateHazards, anchored_window
from cluster.core.render.template_analysis import analyze as analyze_template, concatenates_arguments

log = logging.getLogger("loopserve.render")


def load_tokenizer(config: LoopserveConfig):
    if config.model.is_generated:
        from cluster.models.builtin import ensure_builtin

        # Weights only where an engine loads them (or torch is there anyway).
        ensure_builtin(config.model.builtin, weights=True if backend_of(config.engine).runs_weights else None)
    if config.model.tokenizer_mode == "mistral":
        from vllm.tokenizers.mistral import MistralTokenizer

        return MistralTokenizer.from_pretrained(config.model.resolved_path())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.resolved_path())
    if (template := config.model.chat_template_text()) is not None:
        tokenizer.chat_template = template  # the operator's, as vLLM's --chat-template
    return tokenizer


@dataclass(frozen=True)
class TokenCodec:
    """Text <-> token ids for the engine side (no special tokens added on encode)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]  # special tokens skipped (output text)
    decode_raw: Callable[[Sequence[int]], str]  # special tokens kept (parsers, token reuse)


def token_codec(tokenizer) -> TokenCodec:
    if getattr(tokenizer, "IS_MISTRAL_TOKENIZER", False):
        return TokenCodec(lambda s: tokenizer.encode(s, add_special_tokens=False),
                          lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
                          lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False))
    backend = tokenizer.backend_tokenizer  # the Rust tokenizer: no Python-side overhead
    return TokenCodec(_fast_encode(backend),
                      lambda ids: backend.decode(list(ids), skip_special_tokens=True),
                      lambda ids: backend.decode(list(ids), skip_special_tokens=False))


def _fast_encode(backend) -> Callable[[str], list[int]]:
    """`backend.encode(s).ids` without the character offsets the renderer never reads:
    `encode_batch_fast` (tokenizers >= 0.21) runs the same pipeline and skips them, ~20-40%
    less time on a turn's tool output (0.57 -> 0.46 ms for 2 KB of code, 0.45 -> 0.26 ms for
    prose; SmolLM2's tokenizer, this machine)."""
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None:
        return lambda s: backend.encode(s, add_special_tokens=False).ids
    return lambda s: fast([s], add_special_tokens=False)[0].ids


_PROBED: dict[tuple, ProbeReport] = {}
_ANALYSED: dict[str, TemplateHazards] = {}  # template source -> what reading it found


def renderer_for(tokenizer, probe: bool = True, analysis: bool = True, *,
                 model: Optional[ModelConfig] = None) -> IncrementalRenderer:
    """The incremental renderer for `tokenizer`: the model's family's (`model.renderer`,
    cluster/config/renderers.py; no model: mistral_common's for a Mistral tokenizer, else the
    chat template's), its template read for content-dependence (`template_analysis.py`) and probed
    (`probe.py`; this also compiles the template and touches every render path, so a replica's
    first turn does not pay)."""
    kind = renderer_of(model) if model is not None else \
        RENDERERS["mistral" if getattr(tokenizer, "IS_MISTRAL_TOKENIZER", False) else "jinja"]
    module, _, name = kind.build.partition(":")
    renderer = getattr(importlib.import_module(module), name)(tokenizer, model)
    if analysis and kind.reads_template and renderer.template_source:
        started = time.perf_counter()
        hazards = _ANALYSED.get(renderer.template_source)
        if hazards is None:
            hazards = _ANALYSED[renderer.template_source] = analyze_template(
                renderer.template_source, renderer.guard.protected if renderer.guard else ())
            for found in hazards.where:
                log.info("chat template %s: %s", hazards.digest[:12], found)
        renderer.hazards = hazards
        if hazards.anchor_role:
            renderer.window_start = anchored_window(hazards.anchor_role)
        renderer.startup_ms["analysis"] = round((time.perf_counter() - started) * 1000, 2)
    if probe:
        started = time.perf_counter()
        # Once per process for a tokenizer and template: every renderer of them gets the same proof.
        key = (type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), renderer.template_source,
               tuple(sorted(tokenizer.get_added_vocab())) if hasattr(tokenizer, "get_added_vocab") else ())
        report = _PROBED.get(key) if renderer.template_source else None  # mistral_common: no template text
        if report is None:
            _PROBED[key] = probe_renderer(renderer)
        else:
            renderer.proven, renderer.probe_report = report.proven, report
        renderer.startup_ms["probe"] = round((time.perf_counter() - started) * 1000, 2)
    return renderer


def attach_images(renderer: IncrementalRenderer, config: LoopserveConfig) -> None:
    """A vision model's renderer renders images as the model's placeholder and asks the model's
    processor how many tokens each becomes (`render/images.py`). Text-only models: nothing."""
    images = config.model.images
    if images is None:
        return
    processor, placeholder, placeholder_id = load_processor(config.model.resolved_path(), config.model.name,
                                                            images.placeholder)
    renderer.images = ImageTokens(placeholder, placeholder_id, processor_image_tokens(processor, placeholder_id))


def watch_fallbacks(renderer: IncrementalRenderer, metrics) -> None:
    """Count the renderer's fallbacks in `metrics` and log each reason and steps once."""
    logged: set = set()

    def on_fallback(reason: str, steps: tuple) -> None:
        metrics.render_fell_back(reason)
        if (reason, steps) not in logged and len(logged) < 256:
            logged.add((reason, steps))
            log.info("delta render rendered fully (%s): %s", reason, "; ".join(map(format_step, steps)))

    renderer.on_fallback = on_fallback


def jinja_renderer(tokenizer, model: Optional[ModelConfig] = None) -> IncrementalRenderer:
    """The tokenizer's Jinja chat template, rendered as text and tokenized (what vLLM's server does)."""
    codec = token_codec(tokenizer)

    def apply(messages, tools, add_generation_prompt, **template_kwargs):
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    added = list(tokenizer.get_added_vocab().keys())
    guard = ContentGuard(added, codec.encode)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    renderer = IncrementalRenderer(apply, guard.encode, added, decode=codec.decode_raw, eos=tokenizer.eos_token,
                                   template_source=template, guard=guard)
    renderer.raw_arguments = concatenates_arguments(template)  # calls' arguments as sent, where the template joins them
    renderer.max_token_chars = max_token_chars(tokenizer)
    renderer.min_user_message_tokens = min_user_message_tokens(apply, guard.encode)
    return renderer


def mistral_renderer(tokenizer, model: Optional[ModelConfig] = None) -> IncrementalRenderer:
    """mistral_common's request encoding (what vLLM's tokenizer_mode="mistral" prompts with)."""

    def apply(messages, tools, add_generation_prompt, **_template_kwargs):
        # mistral_common wants 9-character tool call ids, as vLLM's serving truncates them.
        fixed = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "id": _mistral_call_id(c.get("id", ""))} for c in m["tool_calls"]]
            if m.get("tool_call_id"):
                m["tool_call_id"] = _mistral_call_id(m["tool_call_id"])
            m.pop("reasoning", None)
            m.pop("reasoning_content", None)
            fixed.append(m)
        return list(tokenizer.apply_chat_template(fixed, tools=tools, add_generation_prompt=add_generation_prompt))

    codec = token_codec(tokenizer)
    return IncrementalRenderer(apply, codec.encode, [], decode=codec.decode_raw, eos=tokenizer.eos_token_id)


def _mistral_call_id(call_id: str) -> str:
    alnum = "".join(ch for ch in call_id if ch.isalnum())
    return (alnum[-9:] if len(alnum) >= 9 else alnum.rjust(9, "0"))


# Normalizers that compose characters (NFC/NFKC) can turn several characters into one.
_COMPOSING_FACTOR = 4


def max_token_chars(tokenizer) -> Optional[int]:
    """The most characters of input one token of `tokenizer` can stand for (None: unknown, no floor)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # mistral_common, or a slow tokenizer: no vocabulary to read the bound from
        return None
    pre = repr(backend.pre_tokenizer)
    if "Whitespace" in pre or "Bert" in pre:  # whitespace is dropped, not tokenized
        return None
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=0)
    if longest <= 0:
        return None
    return longest * (_COMPOSING_FACTOR if backend.normalizer is not None else 1)


def min_user_message_tokens(apply: Callable[..., str], encode: Callable[[str], Any]) -> int:
    """The fewest tokens one more user message adds to a prompt beyond its text, measured on the
    template: after a user message, with empty and with short content (0 when unknown)."""
    added = []
    for text in ("", "x", "hello world", " \n{x"):
        one = [{"role": "user", "content": text}]
        try:
            more = len(encode(apply(one * 2, None, False))) - len(encode(apply(one, None, False)))
        except Exception:  # noqa: BLE001 - a template that refuses two user messages in a row
            return 0
        added.append(more - len(encode(text)))
    return max(0, min(added))


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value.strip())
    if isinstance(value, list):
        return sum(len(part["text"].strip()) for part in value
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def verbatim_chars(items: Sequence[dict[str, Any]]) -> int:
    """Characters of `items` every chat template renders as they are."""
    total = 0
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer"):
            total += _text_chars(item.get("content"))
        elif kind == "function_call_output":
            total += _text_chars(item.get("output"))
    return total


def kept_items(new_items: Sequence[dict[str, Any]], truncation: Optional[str]) -> Sequence[dict[str, Any]]:
    """The new items every prompt of the turn holds: all of them, or with `truncation: "auto"`
    (which drops whole user turns from the oldest, never the last) those from the last user message on."""
    if truncation != "auto":
        return new_items
    for i in range(len(new_items) - 1, -1, -1):
        item = new_items[i]
        if item.get("type", "message") == "message" and item.get("role") == "user":
            return new_items[i:]
    return new_items


def min_prompt_tokens(items: Sequence[dict[str, Any]], max_chars: Optional[int], per_user_message: int = 0) -> int:
    """A floor on the tokens `items` add to a prompt (0 when the tokenizer gives no bound)."""
    if not max_chars:
        return 0
    users = sum(1 for item in items if item.get("type", "message") == "message" and item.get("role") == "user")
    return verbatim_chars(items) // max_chars + per_user_message * max(0, users - 1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens `a` and `b` share from their start. Token arrays compare by slices (C speed, a
    binary search): this runs before the terminal event, on a prompt as long as the history."""
    n = min(len(a), len(b))
    if isinstance(a, array) and isinstance(b, array) and a.typecode == b.typecode:
        x, y = memoryview(a), memoryview(b)
        lo, hi = 0, n  # x[:lo] == y[:lo]; the first difference is before hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if x[lo:mid] == y[lo:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
