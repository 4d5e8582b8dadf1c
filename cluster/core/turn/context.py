"""Context resolution: previous response + new items, with tool-pairing checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cluster.core.render.images import content_parts
from cluster.core.turn.state import ResponseState
from cluster.protocol.errors import ApiError


@dataclass
class ResolvedContext:
    items: list[dict[str, Any]]  # whole context: parent's items + new input
    new_start: int  # items[new_start:] is this request's new input
    known_call_ids: frozenset[str]
    pending_call_ids: tuple[str, ...]
    parent: Optional[ResponseState]


def resolve_context(new_items: list[dict[str, Any]], parent: Optional[ResponseState]) -> ResolvedContext:
    """Append new input to the parent's context and validate tool pairing over all of it.

    Costs O(new items): the parent's call-id sets summarize its whole history.
    """
    base = parent.items if parent is not None else []
    known = set(parent.known_call_ids) if parent is not None else set()
    pending = list(parent.pending_call_ids) if parent is not None else []
    for item in new_items:
        kind = item.get("type", "message")
        if kind == "function_call":
            known.add(item["call_id"])
            pending.append(item["call_id"])
        elif kind == "function_call_output":
            call_id = item["call_id"]
            if call_id not in known:
                raise ApiError(
                    400,
                    f"No tool call found for function call output with call_id {call_id}.",
                    param="input",
                    code="invalid_value",
                )
            if call_id in pending:
                pending.remove(call_id)
    if pending:
        raise ApiError(
            400,
            f"No tool output found for function call {pending[0]}.",
            param="input",
            code="invalid_value",
        )
    items = base + new_items if new_items else list(base)
    return ResolvedContext(items, len(base), frozenset(known), tuple(pending), parent)


NON_TEXT_PARTS = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


def reject_non_text(new_items: list[dict[str, Any]], model: str) -> None:
    """A text-only model: an image or file part is a 400, never a silent stand-in the model would
    answer about without having seen it."""
    for i, field, j, part in content_parts(new_items):
        what = NON_TEXT_PARTS.get(part.get("type"))
        if what:
            raise ApiError(400, f"The model '{model}' does not support {what} input; send text only.",
                           param=f"input[{i}].{field}[{j}]", code="unsupported_value")


def output_as_context(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as they re-enter the context (the same dict shape as input items). A
    compaction item in the output is already in the context, opened, where the turn compacted."""
    items = []
    for item in output:
        if item.get("type") == "compaction":
            continue
        if item.get("type") == "message":
            items.append({"type": "message", "role": "assistant", "id": item["id"], "content": item["content"]})
        else:
            items.append(item)
    return items


def output_call_ids(output: list[dict[str, Any]]) -> list[str]:
    return [item["call_id"] for item in output if item.get("type") == "function_call"]


def normalize_tools(tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Responses tools -> chat-template function specs.

    Function tools and the functions nested in `namespace` tools (Codex) are
    callable; other tool types (web_search, ...) are accepted and not offered
    to the model.
    """
    out: list[dict[str, Any]] = []
    for tool in tools or []:
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_spec(tool))
        elif kind == "namespace":
            for nested in tool.get("tools") or tool.get("functions") or []:
                if isinstance(nested, dict) and isinstance(nested.get("name"), str):
                    out.append(_function_spec(nested))
    return out


def _function_spec(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
        },
    }
