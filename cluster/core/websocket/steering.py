"""`response.steer` (docs/protocol.md) as plain logic: validating a steer, the events it earns,
the queue of accepted steers per response, and the successor request that commits them.

Semantics (the openai SDK's `ResponseSteerEvent`): a steer names an active response on this
connection and carries user input. `response.steer.accepted` means the server owns the input,
not that it applied; the successor's `response.created` is the commit point. A response without
client-owned tool calls stops (`incomplete`, reason `steered`, keeping the output that went out)
and a successor starts on its lane with the steering input, inheriting its settings; one that
completed first is followed by the successor all the same. A response that stopped for tool
output keeps the steers queued (`response.steer.pending` with the `required_input` stubs) until
the client's explicit `response.create` for that parent, whose input they are prepended to.
Input that cannot be committed comes back in `response.steer.failed`.

The successor is cheap here: its parent's state is cached, so it renders only the new items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cluster.core.events import Event
from cluster.protocol.ids import new_id

MAX_STEERS_PER_RESPONSE = 8
MAX_PENDING_PARENTS = 16  # responses with steers waiting for tool output, per connection
# Bytes of steering input one connection may hold (running responses' and pending parents'
# together): steers wait outside the frame queue's byte bound, so they get their own.
MAX_STEER_BYTES = 4 * 1024 * 1024
_STEER_FIELDS = frozenset({"type", "previous_response_id", "input"})
_MESSAGE_FIELDS = frozenset({"type", "role", "content", "id", "status"})
_PART_TYPES = frozenset({"input_text", "input_image", "input_file"})
# Settings a successor does not inherit: its own input and parent, and warm-up switches.
_NOT_INHERITED = frozenset({"input", "previous_response_id", "generate", "prompt_cache_options"})


class SteerRejected(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Steer:
    id: str
    previous_response_id: str
    input: Any  # as the client sent it: returned unchanged if it cannot be committed
    items: list[dict[str, Any]]  # as input items of the successor

    @property
    def nbytes(self) -> int:
        """What this steer holds (its input as sent and as items; strings are shared)."""
        from cluster.core.turn.cache import items_nbytes

        return 2 * items_nbytes(self.items)


def parse_steer(event: dict[str, Any]) -> Steer:
    """A valid `response.steer` or SteerRejected (`invalid_input`)."""
    extra = sorted(set(event) - _STEER_FIELDS)
    if extra:
        raise SteerRejected("invalid_input", f"response.steer accepts only type, previous_response_id and input; "
                                             f"got {', '.join(extra)} (the target response decides the lane).")
    target = event.get("previous_response_id")
    if not isinstance(target, str) or not target:
        raise SteerRejected("invalid_input", "response.steer needs a 'previous_response_id'.")
    return Steer(id=new_id("steer"), previous_response_id=target, input=event.get("input"),
                 items=steer_items(event.get("input")))


def steer_items(value: Any) -> list[dict[str, Any]]:
    """Steering input as input items: a string, or a non-empty list of user messages whose
    content is a string or input_text / input_image / input_file parts."""
    if isinstance(value, str):
        if not value:
            raise SteerRejected("invalid_input", "Steering input must not be empty.")
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise SteerRejected("invalid_input", "Steering input must be a string or a non-empty array of user messages.")
    items = []
    for n, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") != "user":
            raise SteerRejected("invalid_input", f"input[{n}]: steering accepts only messages with the user role "
                                                 "(no tool outputs or other item types).")
        extra = sorted(set(item) - _MESSAGE_FIELDS)
        if extra:
            raise SteerRejected("invalid_input", f"input[{n}]: a steering message has only type, role and content; "
                                                 f"got {', '.join(extra)}.")
        content = item.get("content")
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") in _PART_TYPES for p in content):
            pass
        elif not (isinstance(content, str) and content):
            raise SteerRejected("invalid_input", f"input[{n}].content must be a non-empty string or an array of "
                                                 "input_text, input_image and input_file parts.")
        items.append({"type": "message", "role": "user", "content": content})
    return items


def accepted(steer: Steer, stream_id: Optional[str]) -> Event:
    ev: Event = {"type": "response.steer.accepted", "sequence_number": 0,
                 "steer": {"id": steer.id, "previous_response_id": steer.previous_response_id}}
    return _on_lane(ev, stream_id)


def failed(code: str, message: str, *, previous_response_id: Any, input: Any, steer_id: Optional[str] = None,
           stream_id: Optional[str] = None) -> Event:
    steer: dict[str, Any] = {"previous_response_id": previous_response_id if isinstance(previous_response_id, str) else "",
                             "input": input}
    if steer_id is not None:
        steer["id"] = steer_id
    ev: Event = {"type": "response.steer.failed", "sequence_number": 0, "steer": steer,
                 "error": {"type": "invalid_request_error", "code": code, "message": message}}
    return _on_lane(ev, stream_id)


def failed_steer(steer: Steer, code: str, message: str, stream_id: Optional[str]) -> Event:
    return failed(code, message, previous_response_id=steer.previous_response_id, input=steer.input,
                  steer_id=steer.id, stream_id=stream_id)


def pending(steer: Steer, required: list[dict[str, Any]], stream_id: Optional[str]) -> Event:
    ev: Event = {"type": "response.steer.pending", "sequence_number": 0, "reason": "waiting_for_required_input",
                 "required_input": required,
                 "steer": {"id": steer.id, "previous_response_id": steer.previous_response_id}}
    return _on_lane(ev, stream_id)


def required_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stubs of the tool results a response's output still owes (client-owned calls)."""
    stubs: list[dict[str, Any]] = []
    for item in output:
        if item.get("type") == "function_call":
            stubs.append({"type": "function_call_output", "call_id": item["call_id"], "name": item["name"]})
        elif item.get("type") == "custom_tool_call":
            stubs.append({"type": "custom_tool_call_output", "call_id": item["call_id"]})
    return stubs


def successor_body(parent_body: dict[str, Any], parent_id: str, steers: list[Steer]) -> dict[str, Any]:
    """The automatic successor: the parent's settings, continuing it with the steering input."""
    body = {k: v for k, v in parent_body.items() if k not in _NOT_INHERITED}
    body["previous_response_id"] = parent_id
    body["input"] = [item for steer in steers for item in steer.items]
    return body


def with_queued_input(body: dict[str, Any], steers: list[Steer]) -> dict[str, Any]:
    """An explicit `response.create` for a parent with pending steers: their input first, in
    submission order, then the request's own."""
    own = body.get("input")
    if isinstance(own, str):
        own = [{"type": "message", "role": "user", "content": own}]
    elif own is None:
        own = []
    if not isinstance(own, list):
        return body  # the request's own validation reports it
    return {**body, "input": [item for steer in steers for item in steer.items] + own}


def _on_lane(ev: Event, stream_id: Optional[str]) -> Event:
    if stream_id:
        ev["stream_id"] = stream_id
    return ev
