"""What a request forces on the output, with vLLM's own machinery.

- `tool_choice` "required", a named function, or `allowed_tools` in mode "required":
  a structural tag from vLLM's registry for the model family's tool-call format
  (`vllm.tool_parsers.structural_tag_registry`, the one vLLM's server uses), so the
  model writes a well-formed call its tool parser reads; `parallel_tool_calls: false`
  stops the tag after one call. Harmony (gpt-oss) has a token-exact lark grammar of its own here.
- `text.format` `json_schema` / `json_object`: vLLM structured outputs (xgrammar).
A forced tool call wins over a text format (as in vLLM's server).
"""

from __future__ import annotations

import functools
import json

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


@functools.lru_cache(maxsize=None)
def _harmony_id(token: str) -> int:
    from cluster.models.o200k import harmony_encoding

    return harmony_encoding().encode(token, allowed_special="all")[0]


def _lark_json(schema: dict[str, Any]) -> str:
    """A JSON value of `schema` in a lark grammar, written compact as gpt-oss writes it (free
    whitespace lets a model pad blank tokens up to max_tokens, a known failure of forced JSON)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def _lark(*parts: str) -> str:
    """A lark grammar (llguidance, vLLM's `guidance` backend): special tokens by id (`<[n]>`), so the
    control tokens are the tokens themselves, never their text (which harmony's parser reads as content)."""
    return "start: " + " ".join(f"<[{_harmony_id(p)}]>" if p.startswith("<|") else p for p in parts)


def harmony_call_grammar(tools: Sequence[ToolSpec], tool_choice: Any) -> str:
    """A forced call in harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}
    <|call|>`. (vLLM 0.32's tag registry has no harmony entry; xgrammar's own tag accepts the control
    tokens spelled in plain text, and its masks let other tokens through where a special token must be.)"""
    named = tool_choice.get("name") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    allowed = ({t.get("name") for t in tool_choice.get("tools", [])}
               if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools" else None)
    offered = [t["function"] for t in tools
               if (named is None or t["function"]["name"] == named) and (allowed is None or t["function"]["name"] in allowed)]
    rules = [f"call{i}: " + _lark("<|channel|>", json.dumps(f"commentary to=functions.{fn['name']} "), "<|constrain|>",
                                  '"json"', "<|message|>", _lark_json(fn.get("parameters") or {"type": "object"}),
                                  "<|call|>")[len("start: "):] for i, fn in enumerate(offered)]
    return "\n".join(["start: " + " | ".join(f"call{i}" for i in range(len(offered))), *rules])


def harmony_final_json_grammar(schema: dict[str, Any]) -> str:
    """A text format on harmony: the final channel's message is the JSON."""
    return _lark("<|channel|>", '"final"', "<|message|>", _lark_json(schema), "<|return|>")


def structured_outputs(tools: Sequence[ToolSpec], tool_choice: Any, parallel_tool_calls: bool,
                       text_format: Optional[dict[str, Any]], tool_parser: str, harmony: bool = False):
    """vLLM `StructuredOutputsParams` for one request, or None when nothing is forced. `harmony`:
    the output is harmony (gpt-oss), so a text format holds the final channel's message."""
    from vllm.sampling_params import StructuredOutputsParams

    if tools and forces_a_tool_call(tool_choice):
        from openai.types.responses import FunctionTool
        from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call

        if harmony:  # one call: `<|call|>` ends the generation
            return StructuredOutputsParams(grammar=harmony_call_grammar(tools, tool_choice))
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
    if harmony and text_format and text_format.get("type") in ("json_schema", "json_object"):
        schema = text_format["schema"] if text_format["type"] == "json_schema" else {"type": "object"}
        return StructuredOutputsParams(grammar=harmony_final_json_grammar(schema))
    if text_format and text_format.get("type") == "json_schema":
        return StructuredOutputsParams(json=text_format["schema"])
    if text_format and text_format.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    return None
