"""A WebSocket frame's JSON, read once: a client event parsed and bounded (`load_event`), or, for a
large `response.create` that will wait behind others, everything but its input (`peek_create`).

A waiting create is held as its frame and parsed when its lane starts it (`WsCreate.frame`):
parsing 10,000 small items on arrival only to drop them and parse them again later held the
event loop ~5 ms a 300 KB frame. The peek decodes the frame's top level with msgspec, keeping
each field's text (`msgspec.Raw`) without building it, and builds every field but `input` with
the same `json.loads` the full path uses: 0.4 ms for that frame, and it checks the whole frame's
syntax on the way. Whatever the peek cannot read the way the full path would (not an object,
`input` nested under `response`, a field json.loads refuses) goes the full path, which answers
it exactly as before.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

import msgspec

from cluster.protocol.errors import ApiError
from cluster.protocol.request_bounds import json_containers_error, json_shape

Frame = Union[str, bytes]
_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])


def load_event(data: Frame, counted: bool = False) -> tuple[dict[str, Any], int]:
    """A client event and what it holds parsed (bytes, an upper bound), or an ApiError (400) for
    a frame opening too many containers (unless the caller `counted` them), not JSON, not an
    object with a string `type`, or nested too deeply."""
    too_complex = None if counted else json_containers_error(data)
    if too_complex is not None:
        raise too_complex
    try:
        event = json.loads(data)
    except (ValueError, RecursionError) as exc:
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(400, f"The message is not valid JSON: {reason}.", code="invalid_json") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ApiError(400, "Each message must be a JSON object with a 'type'.", param="type",
                       code="missing_required_parameter")
    too_deep, held = json_shape(event, data)
    if too_deep is not None:
        raise too_deep
    return event, held


def peek_create(data: Frame) -> Optional[dict[str, Any]]:
    """A `response.create` frame's body without its `input` (checked for depth), or None when the
    frame is not one the peek reads exactly as `load_event` would (the caller parses it whole)."""
    try:
        raw = _TOP_LEVEL.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if "input" not in raw or "type" not in raw:
        return None  # the nested form (`{"type", "response": {...}}`) and the malformed: the full path
    try:
        fields = {k: json.loads(bytes(v)) for k, v in raw.items() if k != "input"}
    except (ValueError, RecursionError):
        return None
    if fields["type"] != "response.create" or json_shape(fields)[0] is not None:
        return None
    del fields["type"]
    return fields
