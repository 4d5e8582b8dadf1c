"""`docs/configuration.md`, generated from the config schema: every section and field with its
type, default and description (the field's docstring in the code).

    python -m cluster.config.docs            # rewrite docs/configuration.md
    python -m cluster.config.docs --check    # exit 1 when it differs from the schema
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from cluster.config import LoopserveConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

HEADER = """# Configuration

The `args:` of a serve config (`serve_configs/local.yaml` is the default) are one `LoopserveConfig`.
Every key is optional; an unknown key is an error at start. Generated from the schema by
`python -m cluster.config.docs` (a test fails when this page and the code differ).
"""


# Bounds that are numbers in the code, not config keys: (constant, value, what it bounds). The
# value is written here (this module sits below the ones that define them); tests/unit/config/
# test_docs.py checks each against its constant.
FIXED_BOUNDS: list[tuple[str, int, str]] = [
    ("cluster.protocol.request_bounds.MAX_JSON_DEPTH", 64, "levels of JSON nesting in a body or frame (400 `invalid_value`)"),
    ("cluster.protocol.request_bounds.MAX_JSON_CONTAINERS", 200_000,
     "JSON objects and arrays a body or frame opens, counted before parsing (400 `json_too_complex`)"),
    ("cluster.protocol.request_bounds.MAX_ECHO_CHARS", 1_048_576,
     "characters of JSON in fields a response echoes without rendering (400 `string_above_max_length`)"),
    ("cluster.protocol.requests.MAX_NAME_CHARS", 256, "characters of a name or id a client picks"),
    ("cluster.core.turn.controls.MAX_SCHEMA_BYTES", 65_536, "bytes of one structured-output or tool schema"),
    ("cluster.core.turn.controls.MAX_PATTERN_CHARS", 1_000, "characters of one `pattern` in a schema"),
    ("cluster.core.turn.controls.MAX_PATTERN_EXPANSION", 2_000, "elements a `pattern` unrolls to"),
    ("cluster.core.turn.controls.MAX_FORCED_TOOLS", 128, "functions a forced tool call chooses among"),
    ("cluster.core.turn.controls.MAX_FORCED_SCHEMA_BYTES", 262_144, "bytes of a forced call's parameters together"),
    ("cluster.core.websocket.protocol.MAX_ACTIVE", 16, "responses running at once on one socket"),
    ("cluster.core.websocket.protocol.MAX_LANES", 32, "named lanes (`stream_id`) on one socket"),
    ("cluster.core.websocket.protocol.ADMIT_BEFORE_PARSE_BYTES", 65_536,
     "a frame larger than this counts against its key's rate limit before it is parsed"),
    ("cluster.core.websocket.steering.MAX_STEER_BYTES", 4_194_304, "bytes of steering input one socket holds"),
    ("cluster.core.websocket.steering.MAX_STEERS_PER_RESPONSE", 8, "steers queued for one response"),
    ("cluster.core.websocket.agent.MAX_INJECTED_BYTES", 16_777_216, "bytes of injected tool output one socket holds"),
    ("cluster.engines.channel.MAX_STREAMS", 256, "requests in flight on one engine replica's direct channel"),
    ("cluster.engines.channel.MAX_CONNECTIONS", 1_024, "authenticated connections to one engine channel"),
    ("cluster.engines.channel.MAX_PENDING_HELLO", 64, "channel connections that have not said HELLO yet"),
    ("cluster.engines.channel.MAX_PENDING_PER_PEER", 8, "of those, from one peer address"),
    ("cluster.serving.connection.HEALTH_TTL_S", 1, "seconds one `/health` readiness check serves every caller"),
    ("cluster.auth.KEYS_FILE_CHECK_S", 5, "seconds between looks at `auth.keys_file` for a change"),
]


def fixed_bounds() -> str:
    rows = [f"| `{name}` | {value:,} | {what} |" for name, value, what in FIXED_BOUNDS]
    return "\n## Fixed bounds\n\nNumbers in the code, not config keys.\n\n| constant | value | what it bounds |\n|---|---|---|\n" \
        + "\n".join(rows) + "\n"


def models_in(annotation: Any) -> list[type[BaseModel]]:
    found = []
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            found.append(arg)
        else:
            found += [a for a in typing.get_args(arg) if isinstance(a, type) and issubclass(a, BaseModel)]
    return found


def type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"\bcluster\.config\.(?:\w+\.)?", "", text)  # a section's module is not part of its type


def default_of(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{field.default!r}`"


def description(field: Any) -> str:
    if field.description:
        return " ".join(field.description.split())
    nested = models_in(field.annotation)
    return " ".join((nested[0].__doc__ or "").split()) if nested else ""


def render() -> str:
    out = [HEADER]
    queue: list[tuple[str, type[BaseModel]]] = [("", LoopserveConfig)]
    seen: set[str] = set()
    while queue:
        path, model = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        title = f"`{path}`" if path else "top level"
        out.append(f"\n## {title}\n")
        doc = " ".join((model.__doc__ or "").split())
        if doc and path:
            out.append(f"{doc}\n")
        out.append("| key | type | default | what it is |\n|---|---|---|---|")
        for name, field in model.model_fields.items():
            cells = [type_name(field.annotation), default_of(field), description(field)]
            out.append(f"| `{name}` | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
            for nested in models_in(field.annotation):
                queue.append((f"{path}.{name}" if path else name, nested))
    return "\n".join(out) + "\n" + fixed_bounds()


def undescribed() -> list[str]:
    """Fields with no description of their own or of their section: none may ship."""
    missing, queue, seen = [], [("", LoopserveConfig)], set()
    while queue:
        path, model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            if not description(field):
                missing.append(f"{model.__name__}.{name}")
            queue += [(f"{path}.{name}", m) for m in models_in(field.annotation)]
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is out of date")
    ns = ap.parse_args(argv)
    text = render()
    if ns.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run `python -m cluster.config.docs`", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
