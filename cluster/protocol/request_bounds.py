"""Bounds a request body is held to before it is validated: how deeply its JSON nests, how much
of it a response echoes back (and a stored row keeps) without rendering it, a WebSocket frame's
size as the wire counts it, the bytes waiting on every connection of a replica, and a socket's bytes a minute."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

import msgspec
import numpy as np

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

Raw = Union[str, bytes, bytearray]
# Each byte's part in nesting: a bracket opens or closes, a quote starts or ends a string.
_NESTING = np.zeros(256, np.int8)
_NESTING[ord('"')] = 2
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1


def json_nesting(raw: Raw) -> int:
    """How deeply JSON text nests objects and arrays (the body itself is 1), read from its bytes in
    numpy: brackets inside strings do not count (escapes are blanked first: `\\\\` pairs, then
    `\\"`). ~3 ms a MiB of small items, ~5 for 1 MiB of `[[],[],...]`, which a Python walk of the
    parsed value took ~270 for. Text that is not JSON gets some number; its parse fails."""
    data = raw.encode() if isinstance(raw, str) else raw
    if b"\\" in data:
        data = data.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    marks = _NESTING[np.frombuffer(data, np.uint8)]
    marks = marks[marks != 0]
    quotes = marks == 2
    marks[quotes] = 0
    marks[(np.cumsum(quotes, dtype=np.int32) & 1).astype(bool)] = 0  # inside a string
    return int(np.cumsum(marks, dtype=np.int32).max(initial=0))


def json_bounds(raw: Raw, max_depth: int = MAX_JSON_DEPTH,
                max_containers: int = MAX_JSON_CONTAINERS) -> tuple[Optional[ApiError], int]:
    """A 400 for JSON text opening more than `max_containers` objects and arrays or nesting deeper
    than `max_depth` below the body, and an upper bound of the bytes its parsed value holds in
    CPython, all read from the text before it is parsed (counts in C, the nesting in numpy): what
    waits parsed is counted as what it holds (a 30-byte item `{"role":"user","content":"a"}` is a
    dict and two strings, ~300 bytes), not as the frame it came in. A dict is ~100 bytes and a list
    56, ~50 an entry (at most one a comma, and one a container), a string ~50 and a character 1
    (4 when any is not ASCII), a number 32 (one at most a comma, and the last)."""
    text = isinstance(raw, str)
    objects, arrays = raw.count("{" if text else b"{"), raw.count("[" if text else b"[")
    if objects + arrays > max_containers:
        return ApiError(400, f"The request opens {objects + arrays} JSON objects and arrays (counted before parsing, "
                             f"strings included); at most {max_containers} are allowed.", code="json_too_complex"), 0
    if objects + arrays > max_depth + 1 and json_nesting(raw) > max_depth + 1:
        return _too_deep(max_depth, _deepest_field(raw, max_depth)), 0
    commas, quotes = raw.count("," if text else b","), raw.count('"' if text else b'"')
    held = (100 * objects + 56 * arrays + 50 * (commas + objects + arrays) + 50 * (quotes // 2)
            + 32 * (commas + 1) + len(raw) * (1 if raw.isascii() else 4))
    return None, held


def _deepest_field(raw: Raw, max_depth: int) -> Optional[str]:
    """The top-level field of a too-deep body that nests past `max_depth` (the error's param)."""
    try:
        fields = _TOP_LEVEL.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return next((k for k, v in fields.items() if json_nesting(bytes(v)) > max_depth), None)


def _too_deep(max_depth: int, param: Optional[str]) -> ApiError:
    return ApiError(400, f"The JSON is nested too deeply: at most {max_depth} levels of objects and "
                         "arrays are allowed.", param=param, code="invalid_value")


def json_depth_error(value: Any, max_depth: int = MAX_JSON_DEPTH) -> Optional[ApiError]:
    """A 400 naming the top-level field of a parsed value that nests deeper than `max_depth`
    (iterative, level by level over containers only; text is checked before parsing by `json_bounds`)."""
    if _levels(value, max_depth + 1) <= max_depth + 1:  # the body itself is depth 0
        return None
    top = next((str(k) for k, v in value.items() if _levels(v, max_depth) > max_depth),
               None) if isinstance(value, dict) else None
    return _too_deep(max_depth, top)


_CONTAINERS = (dict, list)


def _levels(value: Any, max_levels: int) -> int:
    """How many levels of containers `value` is, counted up to `max_levels` + 1."""
    level, levels = [value] if type(value) in _CONTAINERS else [], 0
    while level and levels <= max_levels:
        levels += 1
        level = [v for c in level for v in (c.values() if type(c) is dict else c) if type(v) in _CONTAINERS]
    return levels


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
    a frame opening too many containers or nesting too deeply (unless the caller `counted` it with
    `json_bounds` already: the bound is then 0), not JSON, or not an object with a string `type`."""
    error, held = (None, 0) if counted else json_bounds(data)
    if error is not None:
        raise error
    try:
        event = json.loads(data)
    except (ValueError, RecursionError) as exc:
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ApiError(400, f"The message is not valid JSON: {reason}.", code="invalid_json") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise ApiError(400, "Each message must be a JSON object with a 'type'.", param="type",
                       code="missing_required_parameter")
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
    if fields["type"] != "response.create" or json_depth_error(fields) is not None:
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


class MinuteBudget:
    """`per_minute` bytes, refilled continuously over a minute, starting full."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.left = float(per_minute)
        self._at = now

    def _refill(self, now: float) -> None:
        self.left = min(self.per_minute, self.left + (now - self._at) * self.per_minute / 60.0)
        self._at = now

    def spend(self, nbytes: int, now: float) -> bool:
        """Take `nbytes`, into debt if need be: False once the budget is overdrawn (a client that
        keeps going past it is the one to stop)."""
        self._refill(now)
        self.left -= nbytes
        return self.left >= 0

    def take(self, nbytes: int, now: float) -> bool:
        """Take `nbytes` only if they fit (a single take larger than the whole budget fits a full
        one): False leaves the budget as it was."""
        self._refill(now)
        if nbytes > self.left and self.left < self.per_minute:
            return False
        self.left -= nbytes
        return True

    def refuse(self, nbytes: int, what: str) -> None:
        """The 429 for `nbytes` that did not fit, with when they will."""
        wait = max(0.0, (min(nbytes, self.per_minute) - self.left) * 60.0 / self.per_minute)
        raise ApiError(429, f"Rate limit reached: {self.per_minute} {what} per minute. Try again in {wait:.1f}s.",
                       code="rate_limit_exceeded", retry_after_s=wait)


def frame_bytes(data: Union[str, bytes]) -> int:
    """A frame's size in bytes as it came over the wire (UTF-8 for text frames)."""
    if isinstance(data, bytes):
        return len(data)
    return len(data) if data.isascii() else len(data.encode())


def frame_too_large(size: int, limit: int) -> ApiError:
    # Codex knows this code (`websocket_message_too_large`); the frame is dropped, the socket stays.
    return ApiError(400, f"The message is {size} bytes; the limit is {limit} bytes.",
                    code="websocket_message_too_large")
