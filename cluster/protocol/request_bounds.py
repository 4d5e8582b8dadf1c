"""Bounds a request body is held to before it is validated: how deeply its JSON nests, and how
much of it a response echoes back (and a stored row keeps) without rendering it."""

from __future__ import annotations

import json
from typing import Any, Optional

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
