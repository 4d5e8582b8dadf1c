"""Streaming split of engine text into text, reasoning and tool-call blocks.

The model family's tool-call *format* is decoded by an injected extractor
(`cluster.engines.parsers` wraps vLLM's own tool parsers); this module only
finds the block boundaries while text streams, so plain text is released
token by token and a tool call is released once its block is complete.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from cluster.core.messages import Piece, ReasoningPiece, TextPiece, ToolCallPiece

# tool-call section (with its tags) -> [(name, arguments json)] or None when malformed
ToolCallExtractor = Callable[[str], Optional[list[tuple[str, str]]]]


def json_tool_call_extractor(section: str) -> Optional[list[tuple[str, str]]]:
    """Hermes-format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (no vLLM needed)."""
    body = section.removeprefix("<tool_call>").removesuffix("</tool_call>").strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return [(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))]


class StreamingOutputParser:
    """Feed text deltas, get pieces; `finish()` flushes what is held back."""

    def __init__(
        self,
        extractor: ToolCallExtractor = json_tool_call_extractor,
        *,
        tool_open: str = "<tool_call>",
        tool_close: Optional[str] = "</tool_call>",
        think_open: str = "<think>",
        think_close: str = "</think>",
        tools_enabled: bool = True,
        start_in_reasoning: bool = False,
    ) -> None:
        self._extract = extractor
        self._tool_open, self._tool_close = tool_open, tool_close
        self._think_open, self._think_close = think_open, think_close
        self._tools_enabled = tools_enabled
        self._buf = ""
        # text | tool | think; a prompt that ends in the think tag starts inside reasoning
        self._mode = "think" if start_in_reasoning else "text"
        self.tool_calls = 0

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        out: list[Piece] = []
        while self._buf:
            if self._mode == "tool":
                end = self._buf.find(self._tool_close) if self._tool_close else -1
                if end < 0:  # no end tag (yet, or ever): the section runs on
                    break
                block, self._buf = self._buf[:end], self._buf[end + len(self._tool_close) :]
                self._mode = "text"
                out.extend(self._tool_block(block))
                continue
            close = self._think_close if self._mode == "think" else None
            opens = [] if self._mode == "think" else [self._think_open] + ([self._tool_open] if self._tools_enabled else [])
            tags = ([close] if close else []) + opens
            idx, tag = _first_tag(self._buf, tags)
            if tag is None:
                keep = _partial_tag_suffix(self._buf, tags)
                emit, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                if emit:
                    out.append(self._piece(emit))
                break
            if idx:
                out.append(self._piece(self._buf[:idx]))
            self._buf = self._buf[idx + len(tag) :]
            if tag == self._tool_open:
                self._mode = "tool"
            elif tag == self._think_open:
                self._mode = "think"
            else:
                self._mode = "text"
        return _merge(out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "tool":
            # A section without end tag, or one cut off by max tokens: try it, else text.
            out.extend(self._tool_block(self._buf, terminated=False))
        elif self._buf:
            out.append(self._piece(self._buf))
        self._buf = ""
        self._mode = "text"
        return _merge(out)

    def _piece(self, text: str) -> Piece:
        return ReasoningPiece(text) if self._mode == "think" else TextPiece(text)

    def _tool_block(self, block: str, terminated: bool = True) -> list[Piece]:
        raw = self._tool_open + block + (self._tool_close if terminated and self._tool_close else "")
        calls = self._extract(raw)
        if not calls:
            return [TextPiece(raw)]
        self.tool_calls += len(calls)
        return [ToolCallPiece(name, args) for name, args in calls]


def _first_tag(buf: str, tags: list[str]) -> tuple[int, Optional[str]]:
    best, best_tag = -1, None
    for tag in tags:
        i = buf.find(tag)
        if i >= 0 and (best < 0 or i < best):
            best, best_tag = i, tag
    return best, best_tag


def _partial_tag_suffix(buf: str, tags: list[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a tag."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), 0, -1):
            if buf.endswith(tag[:n]):
                longest = max(longest, n)
                break
    return longest


def _merge(pieces: list[Piece]) -> list[Piece]:
    merged: list[Piece] = []
    for p in pieces:
        if merged and type(p) is type(merged[-1]) and not isinstance(p, ToolCallPiece):
            merged[-1] = type(p)(merged[-1].text + p.text)  # type: ignore[union-attr,call-arg]
        else:
            merged.append(p)
    return merged
