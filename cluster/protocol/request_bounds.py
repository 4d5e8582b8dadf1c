"""Bounds a request body is held to before it is validated: how deeply its JSON nests, how much
of it a response echoes back (and a stored row keeps) without rendering it, a WebSocket frame's
size as the wire counts it, and the bytes waiting on every connection of a replica."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

import msgspec

from cluster.protocol.errors import ApiError

# JSON nesting a request may have: tool schemas and structured content nest a dozen levels;
# nothing a client needs comes near this, and every layer below (size accounting, the
# grammar compiler, json.dumps of the echo) stays far from Python's recursion limit.
MAX_JSON_DEPTH = 64


# Objects and arrays a request body or frame may open, counted in its raw bytes before it is
# parsed (`{` and `[`, those inside strings included: an upper bound, ~1 ms a MB). Parsing costs
# by the value, and holds the GIL (a thread does not help: json.loads of 13.6 MB of small items
# stalled the event loop 0.39 s inline and 0.40 s in a thread): a 16 MiB body of 559k tiny items
# is refused here instead of parsed. A conversation of 10,000 items with content parts and a large
# tool list opens well under 100,000.
MAX_JSON_CONTAINERS = 200_000


def json_containers_error(raw: Any, max_containers: int = MAX_JSON_CONTAINERS) -> Optional[ApiError]:
    """A 400 for a body (bytes or str) opening more JSON objects and arrays than `max_containers`."""
    opened = raw.count(b"{" if isinstance(raw, (bytes, bytearray)) else "{") + \
        raw.count(b"[" if isinstance(raw, (bytes, bytearray)) else "[")
    if opened <= max_containers:
        return None
    return ApiError(400, f"The request opens {opened} JSON objects and arrays (counted before parsing, strings "
                         f"included); at most {max_containers} are allowed.", code="json_too_complex")


def json_depth_error(value: Any, max_depth: int = MAX_JSON_DEPTH) -> Optional[ApiError]:
    """A 400 naming the top-level field that nests deeper than `max_depth` (iterative)."""
    return json_shape(value, max_depth=max_depth)[0]


_CONTAINERS = (dict, list)


def _levels_and_container_bytes(value: Any, max_levels: int) -> tuple[int, int]:
    """How many levels of containers `value` is (counted up to `max_levels` + 1) and what its dicts and lists hold in
    CPython. Level by level over containers only, leaves never visited: ~5x faster than a walk
    of every value (3 ms for 10,000 items instead of 16), and it runs on every frame and body."""
    level, levels, held = [value] if type(value) in _CONTAINERS else [], 0, 0
    while level:
        levels += 1
        if levels > max_levels:
            break
        below: list[Any] = []
        for c in level:
            if type(c) is dict:
                held += 100 + 50 * len(c)  # the table and its keys (json.loads shares a key's string)
                below += [v for v in c.values() if type(v) in _CONTAINERS]
            else:
                held += 56 + 8 * len(c)
                below += [v for v in c if type(v) in _CONTAINERS]
        level = below
    return levels, held


def json_shape(value: Any, raw: Any = None, max_depth: int = MAX_JSON_DEPTH) -> tuple[Optional[ApiError], int]:
    """`json_depth_error`, and an upper bound of the bytes the parsed value holds in CPython: a
    30-byte item `{"role":"user","content":"a"}` is a dict and two strings, ~300 bytes, so what
    waits parsed is counted as what it holds, not as the frame it came in. The leaves are
    weighed from `raw`, the text they were parsed from, counted in C: 50 bytes a string, 1 a
    character (4 when any is not ASCII), 32 a number (one at most per comma, and the last); without
    `raw` only the containers are weighed."""
    levels, held = _levels_and_container_bytes(value, max_depth + 1)  # the body itself is depth 0
    if levels > max_depth + 1:
        top = next((str(k) for k, v in value.items() if _levels_and_container_bytes(v, max_depth)[0] > max_depth),
                   None) if isinstance(value, dict) else None
        return ApiError(400, f"The JSON is nested too deeply: at most {max_depth} levels of objects and "
                             "arrays are allowed.", param=top, code="invalid_value"), held
    if raw is not None:
        quote, comma = (b'"', b",") if isinstance(raw, (bytes, bytearray)) else ('"', ",")
        held += 50 * (raw.count(quote) // 2) + 32 * (raw.count(comma) + 1) + len(raw) * (1 if raw.isascii() else 4)
    return None, held


# Fields a response echoes (and a stored row keeps) that nothing renders: `text` and `reasoning`
# (their extra keys included), `tool_choice`, `prompt_cache_options`, `context_management` and
# tools the model is not offered (web_search, ...). Rendered fields are bounded by the context
# (instructions and tools by the pre-tokenize floor); these by this.
MAX_ECHO_CHARS = 1 << 20
RENDERED_TOOL_TYPES = ("function", "namespace")
ECHOED = ("text", "reasoning", "tool_choice", "prompt_cache_options", "context_management")


def echo_error(body: dict[str, Any]) -> Optional[ApiError]:
    """A 400 naming the largest echoed-only field when they hold more than MAX_ECHO_CHARS together."""
    sizes = {name: len(json.dumps(body[name])) for name in ECHOED if body.get(name) is not None}
    tools = body.get("tools")
    if isinstance(tools, list):
        sizes["tools"] = sum(len(json.dumps(t)) for t in tools
                             if not (isinstance(t, dict) and t.get("type") in RENDERED_TOOL_TYPES))
    total = sum(sizes.values())
    if total <= MAX_ECHO_CHARS:
        return None
    largest = max(sizes, key=sizes.__getitem__)
    return ApiError(400, f"Invalid '{largest}': the fields this server echoes back without rendering ({', '.join(sizes)}) "
                         f"hold {total} characters of JSON; at most {MAX_ECHO_CHARS} are allowed.",
                    param=largest, code="string_above_max_length")


# A WebSocket frame's JSON, read once: a client event parsed and bounded (`load_event`), or, for a
# large `response.create` that will wait behind others, everything but its input (`peek_create`).
# A waiting create is held as its frame and parsed when its lane starts it (`WsCreate.frame`):
# parsing 10,000 small items on arrival only to drop them and parse them again later held the
# event loop ~5 ms a 300 KB frame. The peek decodes the frame's top level with msgspec, keeping
# each field's text (`msgspec.Raw`) without building it, and builds every field but `input` with
# the same `json.loads` the full path uses: 0.4 ms for that frame, and it checks the whole
# frame's syntax on the way. Whatever the peek cannot read the way the full path would (not an
# object, `input` nested under `response`, a field json.loads refuses) goes the full path, which
# answers it exactly as before.
Frame = Union[str, bytes]
_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])


class _Typed(msgspec.Struct):
    type: str


_TYPE_ONLY = msgspec.json.Decoder(_Typed)  # every other field skipped in C, never built


def frame_type(data: Frame) -> Optional[str]:
    """A frame's `type`, read without building anything else (~0.1 ms for 64 KiB of `[[],[],...]`,
    which json.loads and a walk took 7 + 17 ms to build); None when the frame is not an object
    with a string `type` the full path would read the same way (it then answers it)."""
    try:
        return _TYPE_ONLY.decode(data).type
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


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
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # deep nesting: the full path's 400
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


class ReplicaQueue:
    """Bytes of creates waiting on every socket's lanes of one replica (shared by its sockets'
    protocols): a socket's own bound times the sockets a replica takes is no bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held = max(0, self.held - nbytes)


def frame_bytes(data: Union[str, bytes]) -> int:
    """A frame's size in bytes as it came over the wire (UTF-8 for text frames)."""
    if isinstance(data, bytes):
        return len(data)
    return len(data) if data.isascii() else len(data.encode())


def frame_too_large(size: int, limit: int) -> ApiError:
    # Codex knows this code (`websocket_message_too_large`); the frame is dropped, the socket stays.
    return ApiError(400, f"The message is {size} bytes; the limit is {limit} bytes.",
                    code="websocket_message_too_large")
