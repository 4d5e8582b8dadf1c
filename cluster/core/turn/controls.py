"""Request fields that control the output: checked before `response.created`, so a
request a model cannot honour gets a 400 instead of being silently ignored.

- `tool_choice` "required" / a named function / `allowed_tools` (mode required): forced
  through vLLM structural tags (`cluster/engines/vllm/constraints.py`); needs a tool to call
  and a tool-call format vLLM can force.
- `parallel_tool_calls: false`: at most one call (forced calls: in the grammar; else the
  turn keeps the first call).
- `text.format` `json_schema` (needs a schema) / `json_object`: vLLM structured outputs.
- `reasoning.effort`: the chat template's own argument (`reasoning_effort`, or Qwen3's
  `enable_thinking`); a template without one accepts only "none".
- `truncation: "auto"`: see `prepare.TurnPreparer._truncate`.
"""

from __future__ import annotations

from typing import Any, Optional

from cluster.core.generation import Generation, sampling_of
from cluster.core.messages import ToolSpec

from cluster.protocol.errors import ApiError
from cluster.protocol.requests import ResponsesRequest


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
    if req.top_logprobs:
        raise ApiError(400, "Unsupported parameter: 'top_logprobs' (this server returns no logprobs); omit it or "
                            "send 0.", param="top_logprobs", code="unsupported_parameter")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and not isinstance(fmt.schema_, dict):
        raise ApiError(400, "Missing required parameter: 'text.format.schema'.", param="text.format.schema",
                       code="missing_required_parameter")
    if fmt is not None and fmt.type == "json_schema":
        check_grammar_cost(fmt.schema_, "text.format.schema")
    if forces_a_tool_call(req.tool_choice):
        if not tools:
            what = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.get("type")
            raise ApiError(400, f"Tool choice '{what}' must be specified with 'tools' parameter (function tools).",
                           param="tool_choice", code="invalid_value")
        if not can_force_tool_calls:
            raise ApiError(400, f"The model '{model}' cannot be forced to call a tool: its tool-call format has no "
                                "structured-output support. Use tool_choice 'auto'.",
                           param="tool_choice", code="unsupported_value")
        # Forced calls compile every offered function's parameters into one grammar, the
        # functions nested in namespace tools included: each is checked, and so is their sum.
        if len(tools) > MAX_FORCED_TOOLS:
            raise ApiError(400, f"A forced tool call compiles every offered function into one grammar; at most "
                                f"{MAX_FORCED_TOOLS} functions may be offered with it ({len(tools)} were).",
                           param="tools", code="invalid_value")
        params = [spec["function"]["parameters"] for spec in tools]
        for schema, param in zip(params, _function_params(req.tools or [])):
            check_grammar_cost(schema, param)
        if len(params) > 1:
            check_grammar_cost({"anyOf": params}, "tools", max_bytes=MAX_FORCED_SCHEMA_BYTES)


def _function_params(tools: list[dict[str, Any]]) -> list[str]:
    """Where each offered function's parameters are in the request, in `normalize_tools` order."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") == "function":
            out.append(f"tools[{i}].parameters")
        elif tool.get("type") == "namespace":
            field = "tools" if tool.get("tools") else "functions"
            out += [f"tools[{i}].{field}[{j}].parameters" for j, nested in enumerate(tool.get(field) or [])
                    if isinstance(nested, dict) and isinstance(nested.get("name"), str)]
    return out


# What a schema may ask of vLLM's grammar compiler. It compiles on one worker per engine, so
# one slow schema holds back every later request to that replica: measured here, the 47-byte
# pattern ^(a|b){16000}$ took 48 s (6,000: 5.6 s, about quadratic in the expansion).
MAX_SCHEMA_BYTES = 64 * 1024
MAX_FORCED_TOOLS = 128  # functions one forced tool call may choose among (one grammar over all)
MAX_FORCED_SCHEMA_BYTES = 4 * MAX_SCHEMA_BYTES  # their parameters together
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_EXPANSION = 2000  # atoms after expanding bounded repetition ({n,m}), nested ones multiplied
MAX_SCHEMA_EXPANSION = 10 * MAX_PATTERN_EXPANSION  # all patterns of one schema together


def pattern_expansion(pattern: str) -> int:
    """How many atoms a regex expands to once bounded repetitions are unrolled: sequences add,
    nested repetitions multiply; `*`, `+` and `?` are loops or choices (no unrolling)."""
    stack = [0]  # expansion of each open group so far
    last = 0  # the expansion of the atom or group a quantifier would apply to
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = 1
            stack[-1] += 1
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            last = 1
            stack[-1] += 1
            continue
        if c == "(":
            stack.append(0)
            i += 1
            continue
        if c == ")":
            last = stack.pop() if len(stack) > 1 else stack[0]
            stack[-1] += last
            i += 1
            continue
        if c == "{":
            j = pattern.find("}", i)
            bounds = pattern[i + 1 : j].split(",") if j > 0 else []
            if j > 0 and 1 <= len(bounds) <= 2 and all(b.strip().isdigit() or b.strip() == "" for b in bounds) \
                    and bounds[0].strip():
                top = max(int(b) for b in bounds if b.strip())
                stack[-1] += last * (top - 1)
                last *= top
                i = j + 1
                continue
        if c in "*+?|^$":
            i += 1
            continue
        last = 1
        stack[-1] += 1
        i += 1
    return sum(stack)


def check_grammar_cost(schema: Any, param: str, max_bytes: int = 0) -> None:
    """A 400 for a JSON schema whose grammar would take the engine too long to compile."""
    import json

    max_bytes = max_bytes or MAX_SCHEMA_BYTES
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError):
        raise ApiError(400, "The JSON schema cannot be serialized.", param=param, code="invalid_value") from None
    if size > max_bytes:
        raise ApiError(400, f"The JSON schema is {size} bytes; at most {max_bytes} are allowed.",
                       param=param, code="invalid_value")
    stack, total = [schema], 0
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += [k for k in node["patternProperties"] if isinstance(k, str)]
        for pattern in patterns:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise ApiError(400, f"A 'pattern' in the JSON schema is {len(pattern)} characters; at most "
                                    f"{MAX_PATTERN_CHARS} are allowed.", param=param, code="invalid_value")
            cost = pattern_expansion(pattern)
            if cost > MAX_PATTERN_EXPANSION:
                raise ApiError(400, f"The 'pattern' {pattern[:80]!r} repeats too much for structured output: it "
                                    f"unrolls to {cost} elements; at most {MAX_PATTERN_EXPANSION} are allowed.",
                               param=param, code="invalid_value")
            total += cost
            if total > MAX_SCHEMA_EXPANSION:  # many patterns, each within bounds, add up
                raise ApiError(400, f"The JSON schema's patterns unroll to more than {MAX_SCHEMA_EXPANSION} "
                                    "elements together; simplify them.", param=param, code="invalid_value")
        stack.extend(node.values())


def generation_of(req: ResponsesRequest, tools: list[ToolSpec], max_tokens: int,
                  sampling: dict[str, float]) -> Generation:
    """What the request asks the engine to generate: `sampling` is `sampling_of(req, ...)`, the
    value the response echoes too."""
    text = req.text.format if req.text is not None else None
    return Generation(
        max_tokens=max_tokens,
        sampling=sampling_of(req, sampling),
        tools=tuple(tools),
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text_format=text.model_dump(by_alias=True, exclude_none=True) if text is not None and text.type != "text" else None,
    )
