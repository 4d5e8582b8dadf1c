"""Request fields that control the output: checked before `response.created`, so a
request a model cannot honour gets a 400 instead of being silently ignored.

- `tool_choice` "required" / a named function / `allowed_tools` (mode required): forced
  through vLLM structural tags (`cluster/engines/constraints.py`); needs a tool to call
  and a tool-call format vLLM can force.
- `parallel_tool_calls: false`: at most one call (forced calls: in the grammar; else the
  turn keeps the first call).
- `text.format` `json_schema` (needs a schema) / `json_object`: vLLM structured outputs.
- `reasoning.effort`: the chat template's own argument (`reasoning_effort`, or Qwen3's
  `enable_thinking`); a template without one accepts only "none".
- `truncation: "auto"`: see `turn.TurnDriver._truncate`.
"""

from __future__ import annotations

from typing import Any, Optional

from ..protocol.errors import ApiError
from ..protocol.requests import ResponsesRequest


def forces_a_tool_call(tool_choice: Any) -> bool:
    if tool_choice == "required":
        return True
    if isinstance(tool_choice, dict):
        kind = tool_choice.get("type")
        return kind == "function" or (kind == "allowed_tools" and tool_choice.get("mode") == "required")
    return False


def tool_call_limit(req: ResponsesRequest) -> Optional[int]:
    """How many function calls a response may carry (None: no limit)."""
    limits = [n for n in (req.max_tool_calls, 1 if req.parallel_tool_calls is False else None) if n is not None]
    return min(limits) if limits else None


def check_output_controls(req: ResponsesRequest, tools: list[dict[str, Any]], *, model: str,
                          can_force_tool_calls: bool) -> None:
    """Raise a 400 ApiError for output controls this request or model cannot have."""
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and not isinstance(fmt.schema_, dict):
        raise ApiError(400, "Missing required parameter: 'text.format.schema'.", param="text.format.schema",
                       code="missing_required_parameter")
    if forces_a_tool_call(req.tool_choice):
        if not tools:
            what = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.get("type")
            raise ApiError(400, f"Tool choice '{what}' must be specified with 'tools' parameter (function tools).",
                           param="tool_choice", code="invalid_value")
        if not can_force_tool_calls:
            raise ApiError(400, f"The model '{model}' cannot be forced to call a tool: its tool-call format has no "
                                "structured-output support. Use tool_choice 'auto'.",
                           param="tool_choice", code="unsupported_value")


def template_effort_kwargs(template: str, effort: Optional[str]) -> dict[str, Any]:
    """The chat-template arguments for `reasoning.effort`, or a 400 if the template has none."""
    if effort is None:
        return {}
    if "reasoning_effort" in template:
        return {"reasoning_effort": effort}
    if "enable_thinking" in template:
        return {"enable_thinking": effort != "none"}
    if effort == "none":
        return {}
    raise ApiError(400, "Unsupported parameter: 'reasoning.effort' is not supported with this model (its chat "
                        "template has no reasoning-effort argument); omit it or send 'none'.",
                   param="reasoning.effort", code="unsupported_parameter")
