"""Items as the API lists them (a response's input items, a conversation's items): typed, with an
id and a status, content parts whole; and a response's own input, each item given its id."""

from __future__ import annotations

from typing import Any

from cluster.core.turn.cache import ResponseState
from cluster.core.turn.context import without_private
from cluster.protocol.ids import new_id

ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
             "compaction": "cmp"}


def input_with_ids(state: ResponseState) -> list[dict[str, Any]]:
    """A response's input items, each given its id if it had none (stable from then on)."""
    items = state.items[state.input_start : state.output_start]
    for item in items:
        if "id" not in item:
            item["id"] = new_id(ID_PREFIX.get(item.get("type", "message"), "item"))
    return items


def listed_item(item: dict[str, Any], server_side: bool = False) -> dict[str, Any]:
    """An input item as the API lists it (input items, compaction output): typed, with an id, a
    status and content parts, as the Response item schemas require."""
    out = {"type": item.get("type", "message"), **(item if server_side else without_private(item))}
    kind = out["type"]
    if kind in ID_PREFIX and not out.get("id"):
        out["id"] = new_id(ID_PREFIX[kind])
    if kind == "message":
        content = out.get("content")
        if isinstance(content, str):
            part_type = "output_text" if out.get("role") == "assistant" else "input_text"
            content = [{"type": part_type, "text": content}]
        out["content"] = [_listed_part(p) if isinstance(p, dict) else p for p in content or []]
        out.setdefault("status", "completed")
    elif kind in ("function_call", "function_call_output"):
        out.setdefault("status", "completed")
    elif kind == "reasoning":
        out.setdefault("summary", [])
    return out


def _listed_part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") == "output_text":
        return {"annotations": [], **part}
    if part.get("type") == "input_image":
        return {"detail": "auto", **part}
    return part
