"""A finished response's event stream, rebuilt from the stored object (`GET /v1/responses/{id}?stream=true`)."""

from __future__ import annotations

from typing import Any

from cluster.core.events import Event, EventAssembler, usage_object


def replay_events(response: dict[str, Any]) -> list[Event]:
    """The event stream of a finished response, rebuilt from the stored object.

    Same item ids and final objects; each text comes as one delta, so
    sequence numbers are those of the replay, not of the original stream.
    """
    skeleton = {**response, "status": "in_progress", "output": [], "usage": None, "completed_at": None,
                "incomplete_details": None, "error": None}
    asm = EventAssembler(skeleton)
    events = asm.start()
    for item in response.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            text = "".join(p.get("text") or "" for p in item.get("content") or [])
            events += asm.text(text, item_id=item["id"])
        elif kind == "reasoning":
            text = "".join(p.get("text") or "" for p in item.get("content") or [])
            events += asm.reasoning(text, item_id=item["id"])
        elif kind == "function_call":
            events += asm.tool_call(item["name"], item.get("arguments") or "", item_id=item.get("id"),
                                    call_id=item.get("call_id"), namespace=item.get("namespace"))
    status = response.get("status")
    if status == "failed":
        return events + asm.failed(response.get("error"), response.get("usage"))
    reason = (response.get("incomplete_details") or {}).get("reason") if status == "incomplete" else None
    events += asm.finish(response.get("usage") or usage_object(0, 0, 0), incomplete_reason=reason)
    events[-1]["response"].update(completed_at=response.get("completed_at"), created_at=response.get("created_at"))
    if status == "cancelled":
        events[-1]["response"]["status"] = "cancelled"
    return events
