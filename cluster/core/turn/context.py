"""A turn's context: the previous response's items + the new input, with tool-pairing checks;
and the items that carry sealed content (compaction items, and reasoning items returned with
`include: ["reasoning.encrypted_content"]`).

On the way in (`open_sealed`), each blob is opened for the request's tenant before anything is
resolved or rendered: a compaction item gets its summary in `SUMMARY` (what the renderer shows the
model; never listed back to a client), a reasoning item gets its text back as `content`, where the
template decides whether to render it. A blob that does not open is a 400 naming the item.
On the way out, `compaction_item` and `seal_reasoning` make the blobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cluster.core.render.chat_messages import COMPACTION_SUMMARY as SUMMARY, content_parts
from cluster.core.turn.cache import ResponseState
from cluster.protocol.errors import ApiError
from cluster.protocol.ids import new_id
from cluster.protocol.sealing import Sealer, unopenable


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
    compaction item in the output is already in the context, opened, where the turn compacted; so
    are what a turn outputs before it generates (an MCP server's tool list, an approved MCP call:
    turn/mcp_steps.py)."""
    items = []
    for item in output:
        kind = item.get("type")
        if kind in ("compaction", "mcp_list_tools") or (kind == "mcp_call" and item.get("approval_request_id")):
            continue
        if item.get("type") == "message":
            items.append({"type": "message", "role": "assistant", "id": item["id"], "content": item["content"]})
        else:
            items.append(item)
    return items


def output_call_ids(output: list[dict[str, Any]]) -> list[str]:
    """The tool calls an output leaves waiting for their results: function calls, and a server-run
    MCP call not answered yet (a step's parent as the model made it: turn/steps.py)."""
    return [item["call_id"] if item.get("type") == "function_call" else item["id"] for item in output
            if item.get("type") == "function_call" or (item.get("type") == "mcp_call" and item.get("output") is None
                                                       and not item.get("error") and not item.get("approval_request_id"))]


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


INCLUDE_REASONING = "reasoning.encrypted_content"


def open_sealed(items: Sequence[dict[str, Any]], sealer: Optional[Sealer], tenant: Optional[str],
                *, first_index: int = 0) -> list[dict[str, Any]]:
    """`items` with their sealed content opened (copies of the items that change).

    Without a sealer (a server configured to seal nothing) a compaction item cannot be read and
    is refused the same way; a reasoning item's blob is then left unread (its summary stands)."""
    out = list(items)
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        param = f"input[{i + first_index}].encrypted_content"
        if kind == "compaction":
            if sealer is None:
                raise unopenable(param, item.get("id"))
            payload = sealer.open("compaction", item.get("encrypted_content"), tenant, param=param,
                                  item_id=item.get("id"))
            out[i] = {**item, SUMMARY: str(payload.get("summary", ""))}
        elif kind == "reasoning" and item.get("encrypted_content") and sealer is not None:
            payload = sealer.open("reasoning", item["encrypted_content"], tenant, param=param, item_id=item.get("id"))
            out[i] = {**item, "content": [{"type": "reasoning_text", "text": str(payload.get("text", ""))}]}
    return out


def compaction_item(summary: str, sealer: Sealer, tenant: Optional[str]) -> dict[str, Any]:
    """The one `compaction` item standing for what a compaction dropped."""
    return {"id": new_id("cmp"), "type": "compaction",
            "encrypted_content": sealer.seal("compaction", {"summary": summary}, tenant)}


def seal_reasoning(text: str, sealer: Sealer, tenant: Optional[str]) -> str:
    return sealer.seal("reasoning", {"text": text}, tenant)


def without_private(item: dict[str, Any]) -> dict[str, Any]:
    """An item as a client may see it: no server-side keys."""
    return {k: v for k, v in item.items() if not k.startswith("_")} if SUMMARY in item else item
