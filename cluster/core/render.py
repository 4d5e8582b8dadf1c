"""Incremental chat-template rendering: render only new items, append their tokens.

Exactness contract: prefix tokens + delta tokens == tokens of a full render of
the same context. The delta is the render of (anchor + new) minus the render of
the anchor, where the anchor is the last message already rendered; it is used
only when (a) the anchor render is a true prefix and (b) every piece starts with
a special token, so the tokenizer cannot merge across the cut. Otherwise the
renderer falls back to a full render (correct, O(history), counted).
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .messages import RenderJob

Message = dict[str, Any]
ApplyTemplate = Callable[[list[Message], Optional[list[dict[str, Any]]], bool], str]
Encode = Callable[[str], list[int]]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(part.get("text") or "")
        elif kind == "refusal":
            parts.append(part.get("refusal") or "")
        elif kind == "input_image":
            parts.append("[image]")
        elif kind == "input_file":
            parts.append(f"[file {part.get('filename') or part.get('file_id') or ''}]".replace(" ]", "]"))
    return "".join(parts)


def compaction_text(item: dict[str, Any]) -> str:
    """A compaction item (ours: base64 JSON with a summary) as the text the model sees."""
    import base64

    try:
        data = json.loads(base64.b64decode(item.get("encrypted_content") or "", validate=True))
        return "Summary of the earlier conversation:\n" + str(data["summary"])
    except Exception:  # another server's opaque compaction: keep a marker
        return "[earlier conversation compacted]"


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def messages_from_items(items: Sequence[dict[str, Any]]) -> tuple[list[Message], list[int]]:
    """Responses items -> chat messages, plus the item index where each message starts.

    An assistant message and the function calls that follow it form one
    assistant turn (that is how the model produced them, so the render matches
    the tokens the engine already holds in its prefix cache).
    """
    messages: list[Message] = []
    starts: list[int] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            if role == "developer":
                role = "system"
            messages.append({"role": role, "content": _content_text(item.get("content"))})
            starts.append(i)
        elif kind == "function_call":
            call = {
                "type": "function",
                "id": item["call_id"],
                "function": {"name": item["name"], "arguments": _arguments(item.get("arguments") or "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and _is_assistant_run(items, starts[-1], i):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                starts.append(i)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _content_text(item.get("output"))}
            )
            starts.append(i)
        elif kind == "compaction":
            messages.append({"role": "system", "content": compaction_text(item)})
            starts.append(i)
        # reasoning items are not re-rendered (chat templates drop past reasoning)
    return messages, starts


def _is_assistant_run(items: Sequence[dict[str, Any]], start: int, end: int) -> bool:
    for item in items[start:end]:
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue
        if kind == "function_call":
            continue
        if kind == "message" and item.get("role") == "assistant":
            continue
        return False
    return True


@dataclass
class RenderResult:
    """What a render sends back: only the new tokens (O(new items) on the wire)."""

    appended: array  # tokens to append to the cached prefix (a full render: the whole prefix)
    generation: array  # the generation prompt's tokens, after the prefix
    anchor_start: int  # item index of the last rendered message
    full: bool  # True when this was a full render
    rendered_chars: int  # characters of template text rendered
    # A full render whose generation prompt cannot be cut off at a special token.
    prompt_override: Optional[array] = None

    def assemble(self, base: Optional[array]) -> tuple[array, array]:
        """(prefix, prompt) given the cached prefix this delta extends."""
        prefix = self.appended if self.full or base is None else base + self.appended
        prompt = self.prompt_override if self.prompt_override is not None else prefix + self.generation
        return prefix, prompt

    @property
    def delta_tokens(self) -> int:
        return len(self.appended) + len(self.generation)


class IncrementalRenderer:
    """Chat template + tokenizer, rendering only what is new when it can."""

    def __init__(self, apply_template: ApplyTemplate, encode: Encode, special_tokens: Sequence[str]) -> None:
        self._apply = apply_template
        self._encode = encode
        # Longest first so startswith checks find the right token.
        self._specials = tuple(sorted((s for s in special_tokens if s), key=len, reverse=True))
        self.full_renders = 0
        self.delta_renders = 0

    def warm_up(self) -> None:
        """Compile the chat template and touch every render path once (a replica's first
        real turn would otherwise pay for it); the counters start from zero after."""
        tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        items = [{"type": "message", "role": "user", "content": "hi"},
                 {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "c", "output": "ok"}]
        for tool_set in (tools, None):
            self.full(items[:1], "warm up", tool_set)
            self.delta(items[:1], items[1:], 0, "warm up", tool_set)
        self.full_renders = self.delta_renders = 0

    def _system(self, instructions: Optional[str]) -> list[Message]:
        return [{"role": "system", "content": instructions}] if instructions else []

    def _safe_cut(self, text: str) -> bool:
        return not text or text.startswith(self._specials)

    def full(
        self, items: Sequence[dict[str, Any]], instructions: Optional[str], tools: Optional[list[dict[str, Any]]]
    ) -> RenderResult:
        self.full_renders += 1
        messages, starts = messages_from_items(items)
        msgs = self._system(instructions) + messages
        tools = tools or None
        text = self._apply(msgs, tools, False) if msgs else ""
        with_gen = self._apply(msgs, tools, True)
        prefix = array("i", self._encode(text))
        suffix = with_gen[len(text) :]
        anchor = starts[-1] if starts else 0
        if with_gen.startswith(text) and self._safe_cut(suffix):
            return RenderResult(prefix, array("i", self._encode(suffix)), anchor, True, len(with_gen))
        return RenderResult(prefix, array("i"), anchor, True, len(with_gen), array("i", self._encode(with_gen)))

    def delta(
        self,
        anchor_items: Sequence[dict[str, Any]],
        new_items: Sequence[dict[str, Any]],
        anchor_start: int,
        instructions: Optional[str],
        tools: Optional[list[dict[str, Any]]],
    ) -> Optional[RenderResult]:
        """Tokens for `new_items` appended after a cached prefix; None if unsafe."""
        tools = tools or None
        system = self._system(instructions)
        anchor_msgs, _ = messages_from_items(anchor_items)
        both_msgs, both_starts = messages_from_items(list(anchor_items) + list(new_items))
        base = self._apply(system + anchor_msgs, tools, False) if (system or anchor_msgs) else ""
        text = self._apply(system + both_msgs, tools, False) if (system or both_msgs) else ""
        with_gen = self._apply(system + both_msgs, tools, True)
        if not text.startswith(base) or not with_gen.startswith(text):
            return None
        delta_text, gen_text = text[len(base) :], with_gen[len(text) :]
        if not (self._safe_cut(delta_text) and self._safe_cut(gen_text)):
            return None
        self.delta_renders += 1
        delta_ids = array("i", self._encode(delta_text)) if delta_text else array("i")
        new_anchor = anchor_start + both_starts[-1] if both_starts else anchor_start
        return RenderResult(delta_ids, array("i", self._encode(gen_text)), new_anchor, False, len(with_gen))


def render_job(renderer: IncrementalRenderer, job: RenderJob) -> tuple[Optional[RenderResult], bool]:
    """Run a render job from the turn driver; returns (result, mismatch).

    `verify_items` + `verify_prefix` (tests, debugging) check the delta against a full render;
    on a mismatch the full render is returned, so output stays correct.
    """
    if not job.delta:
        return renderer.full(job.items, job.instructions, job.tools), False
    res = renderer.delta(job.anchor_items, job.new_items, job.anchor_start, job.instructions, job.tools)
    if res is not None and job.verify_items is not None:
        full = renderer.full(job.verify_items, job.instructions, job.tools)
        if full.assemble(None)[1] != res.assemble(job.verify_prefix)[1]:
            return full, True
    return res, False
