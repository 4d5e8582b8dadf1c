"""Tool-call extraction with vLLM's own parsers (per model family, by name)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..core.output_parser import ToolCallExtractor, json_tool_call_extractor

log = logging.getLogger(__name__)

# Block delimiters of the tool-call formats the streaming splitter knows.
TAGS = {"hermes": ("<tool_call>", "</tool_call>")}


def vllm_tool_call_extractor(parser_name: str, tokenizer: Any) -> ToolCallExtractor:
    """Wrap vLLM's `ToolParserManager` parser; falls back to plain JSON if vLLM is absent."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except Exception:  # vLLM not installed (a CPU-only dev box without [cpu])
        log.warning("vLLM not importable; using the JSON tool-call extractor")
        return json_tool_call_extractor
    parser = ToolParserManager.get_tool_parser(parser_name)(tokenizer)
    open_tag, close_tag = TAGS.get(parser_name, ("<tool_call>", "</tool_call>"))
    logging.getLogger(parser.__class__.__module__).setLevel(logging.CRITICAL)  # malformed blocks are text, not errors

    def extract(block: str) -> Optional[list[tuple[str, str]]]:
        info = parser.extract_tool_calls(f"{open_tag}{block}{close_tag}", None)  # type: ignore[arg-type]
        if not info.tools_called:
            return None
        return [(tc.function.name, tc.function.arguments) for tc in info.tool_calls]

    return extract
