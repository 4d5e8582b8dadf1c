"""Output parsing per model family with vLLM's own tool-call and reasoning parsers.

The streaming splitter (`cluster.engines.output_parser`) only needs to know where
a family's tool-call section starts (and ends, if it has an end tag) and which
tags delimit reasoning; decoding the section is vLLM's parser's job
(`ToolParserManager`), so a family is supported exactly as vLLM supports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from cluster.engines.output_parser import ToolCallExtractor, json_tool_call_extractor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: Optional[str]  # None: the tool-call section runs to the end of the output
    # vLLM has a structural tag for it (the parser's `structural_tag_model`): forced
    # tool calls (tool_choice required/named) work. Known here without importing vLLM,
    # for connection nodes that have none; a unit test checks it against vLLM.
    forcible: bool = True


# Families whose tool-call section begins at a marker (vLLM parser name -> format).
TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("<tool_call>", "</tool_call>"),  # Hermes, Qwen2.5, Qwen3
    "qwen3_xml": ToolFormat("<tool_call>", "</tool_call>"),  # Qwen3-Coder XML calls
    "qwen3_coder": ToolFormat("<tool_call>", "</tool_call>"),
    "llama3_json": ToolFormat("<|python_tag|>", None),  # Llama 3.1/3.2 JSON calls
    "mistral": ToolFormat("[TOOL_CALLS]", None, forcible=False),
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
        return lambda section: json_tool_call_extractor(_strip_tags(section, parser_name))
    parser = ToolParserManager.get_tool_parser(parser_name)(tokenizer)
    # A malformed section is returned as text, which is not an error worth a traceback.
    logging.getLogger(type(parser).__module__).setLevel(logging.CRITICAL)

    def extract(section: str) -> Optional[list[tuple[str, str]]]:
        info = parser.extract_tool_calls(section, None)  # type: ignore[arg-type]
        if not info.tools_called or not info.tool_calls:
            return None
        return [(tc.function.name, tc.function.arguments) for tc in info.tool_calls]

    return extract


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
