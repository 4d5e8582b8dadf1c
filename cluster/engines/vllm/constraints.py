"""What a request forces on the output, with vLLM's own machinery.

- `tool_choice` "required", a named function, or `allowed_tools` in mode "required":
  a structural tag from vLLM's registry for the model family's tool-call format
  (`vllm.tool_parsers.structural_tag_registry`, the one vLLM's server uses), so the
  model writes a well-formed call its tool parser reads; `parallel_tool_calls: false`
  stops the tag after one call.
- `text.format` `json_schema` / `json_object`: vLLM structured outputs (xgrammar).
A forced tool call wins over a text format (as in vLLM's server).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from cluster.core.messages import ToolSpec
from cluster.core.turn.controls import forces_a_tool_call


def structural_tag_model(tool_parser: str) -> Optional[str]:
    """The structural-tag format of a vLLM tool parser (None: its calls cannot be forced)."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except Exception:  # vLLM not installed: nothing to force with
        return None
    return getattr(ToolParserManager.get_tool_parser(tool_parser), "structural_tag_model", None)


def _vllm_tool_choice(tool_choice: Any) -> Any:
    from openai.types.responses import ToolChoiceAllowed, ToolChoiceFunction

    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        return ToolChoiceFunction(type="function", name=tool_choice["name"])
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        return ToolChoiceAllowed(type="allowed_tools", mode=tool_choice["mode"], tools=tool_choice["tools"])
    return tool_choice


def structured_outputs(tools: Sequence[ToolSpec], tool_choice: Any, parallel_tool_calls: bool,
                       text_format: Optional[dict[str, Any]], tool_parser: str):
    """vLLM `StructuredOutputsParams` for one request, or None when nothing is forced."""
    from vllm.sampling_params import StructuredOutputsParams

    if tools and forces_a_tool_call(tool_choice):
        from openai.types.responses import FunctionTool
        from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call

        model = structural_tag_model(tool_parser)
        if model is None:
            raise ValueError(f"the {tool_parser!r} tool-call format cannot be forced")
        specs = [FunctionTool(type="function", name=t["function"]["name"], parameters=t["function"]["parameters"],
                              description=t["function"].get("description") or None, strict=True) for t in tools]
        tag = get_model_structural_tag(model=model, tools=specs, tool_choice=_vllm_tool_choice(tool_choice),
                                       reasoning=False)
        if tag is None:
            return None
        if not parallel_tool_calls:
            tag = limit_to_single_tool_call(tag)
        return StructuredOutputsParams(structural_tag=tag.model_dump_json())
    if text_format and text_format.get("type") == "json_schema":
        return StructuredOutputsParams(json=text_format["schema"])
    if text_format and text_format.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    return None
