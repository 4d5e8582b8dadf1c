"""Output parsing: the streaming split of engine text into text, reasoning and tool-call blocks,
and each model family's formats, decoded with vLLM's own tool-call and reasoning parsers.

The splitter (`StreamingOutputParser`) only finds the block boundaries while text streams, so
plain text is released token by token and a tool call once its block is complete. It needs to
know where a family's tool-call section starts (and ends, if it has an end tag) and which tags
delimit reasoning (`ToolFormat`, `reasoning_tags`); decoding the section is vLLM's parser's job
(`ToolParserManager`, behind `vllm_tool_call_extractor`), so a family is supported exactly as
vLLM supports it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from cluster.core.messages import Piece, ReasoningPiece, TextPiece, ToolCallPiece, merged

log = logging.getLogger(__name__)

# tool-call section (with its tags) -> [(name, arguments json)] or None when malformed
# (a tool-call section, the tools the request offered) -> [(name, arguments)], or None when it holds no call
ToolCallExtractor = Callable[[str, Sequence[dict]], Optional[list[tuple[str, str]]]]


def json_tool_call_extractor(section: str, tools: Sequence[dict] = ()) -> Optional[list[tuple[str, str]]]:
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


class OutputParser(Protocol):
    """Engine deltas in (their text and token ids), pieces out; `finish()` flushes what is held."""

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


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
        bare_start: str = "",
        tools: Sequence[dict] = (),
    ) -> None:
        self._extract = extractor
        self._tool_open, self._tool_close = tool_open, tool_close
        self._think_open, self._think_close = think_open, think_close
        self._tools_enabled = tools_enabled
        self._tools = tools  # the request's (ToolSpec): a family's parser types arguments by their schema
        self._buf = ""
        # text | tool | think; a prompt that ends in the think tag starts inside reasoning
        self._mode = "think" if start_in_reasoning else "text"
        # Newlines around reasoning are the template's layout, not text (`<think>\n{reasoning}\n</think>\n\n
        # {content}`, which reasoning templates write with strip('\n') and lstrip('\n')): dropped after
        # either tag and before the closing one, so no whitespace-only message stands between reasoning and a call.
        self._trim_lead = start_in_reasoning
        # A family whose calls may come without their tag (Llama 3's JSON): an output opening with
        # `bare_start` is a call section; decided once the first text that is not blank arrives.
        self._bare_start = bare_start if tools_enabled else ""
        self._untagged = False  # the section in progress opened without its tag
        self.tool_calls = 0

    def feed(self, delta: str, token_ids: Sequence[int] = ()) -> list[Piece]:
        self._buf += delta
        out: list[Piece] = []
        if self._bare_start and self._mode == "text":
            head = self._buf.lstrip()
            if not head or (len(head) < len(self._bare_start) and self._bare_start.startswith(head)):
                return []  # not decided yet
            if head.startswith(self._bare_start):
                self._mode, self._untagged, self._buf = "tool", True, head
            self._bare_start = ""
        while self._buf:
            if self._mode == "tool":
                end = self._buf.find(self._tool_close) if self._tool_close else -1
                if end < 0:  # no end tag (yet, or ever): the section runs on
                    break
                block, self._buf = self._buf[:end], self._buf[end + len(self._tool_close) :]
                self._mode, self._trim_lead = "text", True  # the newline templates write between calls is layout
                out.extend(self._tool_block(block))
                continue
            close = self._think_close if self._mode == "think" else None
            opens = [] if self._mode == "think" else [self._think_open] + ([self._tool_open] if self._tools_enabled else [])
            tags = ([close] if close else []) + opens
            idx, tag = _first_tag(self._buf, tags)
            if tag is None:
                keep = _partial_tag_suffix(self._buf, tags)
                emit = self._buf[: len(self._buf) - keep]
                if self._mode == "think":  # newlines that may end the reasoning wait for what follows them
                    emit = emit.rstrip("\n")
                self._buf = self._buf[len(emit):]
                self._emit(out, emit)
                break
            before = self._buf[:idx]
            self._emit(out, before.rstrip("\n") if tag == close else before)
            self._buf = self._buf[idx + len(tag) :]
            if tag == self._tool_open:
                self._mode = "tool"
            elif tag == self._think_open:
                self._mode, self._trim_lead = "think", True
            else:
                self._mode, self._trim_lead = "text", True
        return merged([out])  # type: ignore[return-value]  # pieces in, pieces out

    def _emit(self, out: list, text: str) -> None:
        if self._trim_lead:
            text = text.lstrip("\n")
            self._trim_lead = not text
        if text:
            out.append(self._piece(text))

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "tool":
            # A section without end tag, or one cut off by max tokens: try it, else text.
            out.extend(self._tool_block(self._buf, terminated=False))
        elif self._buf:
            self._emit(out, self._buf.rstrip("\n") if self._mode == "think" else self._buf)
        self._buf = ""
        self._mode = "text"
        return merged([out])  # type: ignore[return-value]  # pieces in, pieces out

    def _piece(self, text: str) -> Piece:
        return ReasoningPiece(text) if self._mode == "think" else TextPiece(text)

    def _tool_block(self, block: str, terminated: bool = True) -> list[Piece]:
        opened, self._untagged = ("" if self._untagged else self._tool_open), False
        raw = opened + block + (self._tool_close if terminated and self._tool_close else "")
        calls = self._extract(raw, self._tools)
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


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: Optional[str]  # None: the tool-call section runs to the end of the output
    # vLLM has a structural tag for it (the parser's `structural_tag_model`): forced
    # tool calls (tool_choice required/named) work. Known here without importing vLLM,
    # for connection nodes that have none; a unit test checks it against vLLM.
    forcible: bool = True
    bare_start: str = ""  # an output opening with this is a call without the start tag (vLLM's parser reads both)


# Families whose tool-call section begins at a marker (vLLM parser name -> format).
TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("<tool_call>", "</tool_call>"),  # Hermes, Qwen2.5, Qwen3
    "qwen3_xml": ToolFormat("<tool_call>", "</tool_call>"),  # Qwen3-Coder XML calls
    "qwen3_coder": ToolFormat("<tool_call>", "</tool_call>"),
    # Llama 3.1/3.2 JSON calls: after <|python_tag|>, or a whole output that is `{"name": ..., "parameters": ...}`
    "llama3_json": ToolFormat("<|python_tag|>", None, bare_start="{"),
    "mistral": ToolFormat("[TOOL_CALLS]", None, forcible=False),
    # DeepSeek-V3 / R1: calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, a ```json block each
    "deepseek_v3": ToolFormat("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
}

# Reasoning tags when no vLLM reasoning parser is configured.
DEFAULT_THINK = ("<think>", "</think>")


def supported_tool_parsers() -> list[str]:
    return sorted(TOOL_FORMATS)


def tool_format(parser_name: str) -> ToolFormat:
    try:
        return TOOL_FORMATS[parser_name]
    except KeyError:
        raise ValueError(
            f"tool parser {parser_name!r} is not supported for streaming; supported: {supported_tool_parsers()}"
        ) from None


def vllm_tool_call_extractor(parser_name: str, tokenizer: Any) -> ToolCallExtractor:
    """vLLM's parser `parser_name` as a section -> [(name, arguments)] function."""
    tool_format(parser_name)
    try:
        from vllm.tool_parsers import ToolParserManager
    except Exception:  # vLLM not installed (a dev box without [cpu] or [vllm])
        log.warning("vLLM is not importable; using the plain JSON tool-call extractor")
        return lambda section, tools=(): json_tool_call_extractor(_strip_tags(section, parser_name))
    parser = ToolParserManager.get_tool_parser(parser_name)(tokenizer)
    # A malformed section is returned as text, which is not an error worth a traceback.
    logging.getLogger(type(parser).__module__).setLevel(logging.CRITICAL)

    def extract(section: str, tools: Sequence[dict] = ()) -> Optional[list[tuple[str, str]]]:
        # The offered tools' schemas: a parser that writes values as text (Qwen3-Coder's XML) types them by it.
        info = parser.extract_tool_calls(section, _ParserRequest(tools))  # type: ignore[arg-type]
        if not info.tools_called or not info.tool_calls:
            return None
        return [(tc.function.name, tc.function.arguments) for tc in info.tool_calls]

    return extract


class _ParserRequest:
    """What vLLM's tool parsers read of a request: its tools (as vLLM's own models) and tool choice."""

    tool_choice = "auto"

    def __init__(self, tools: Sequence[dict]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

        self.tools = [ChatCompletionToolsParam.model_validate(t) for t in tools] or None


def _strip_tags(section: str, parser_name: str) -> str:
    fmt = TOOL_FORMATS[parser_name]
    body = section[len(fmt.start) :] if section.startswith(fmt.start) else section
    if fmt.end and body.endswith(fmt.end):
        body = body[: -len(fmt.end)]
    return body.strip()


def reasoning_tags(parser_name: Optional[str], tokenizer: Any) -> tuple[str, str]:
    """Start/end tags of vLLM's reasoning parser `parser_name` (default `<think>`)."""
    if not parser_name:
        return DEFAULT_THINK
    from vllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser(parser_name)(tokenizer)
    start, end = getattr(parser, "start_token", None), getattr(parser, "end_token", None)
    end_ids = getattr(parser, "reasoning_end_token_ids", None)
    if not isinstance(end, str) and end_ids:
        # Engine-style adapters (e.g. qwen3) expose token ids, not strings.
        # They list every token that ends reasoning (e.g. a tool-call tag too).
        candidates = [tokenizer.decode([i]) for i in sorted(end_ids)]
        end = next((c for c in candidates if c.startswith("</") and "think" in c), candidates[0])
        start = start if isinstance(start, str) else DEFAULT_THINK[0]
    if not (isinstance(start, str) and isinstance(end, str)):
        raise ValueError(f"reasoning parser {parser_name!r} has no start/end tags to stream on")
    return start, end
