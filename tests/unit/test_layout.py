"""The shape of the code, checked: no import circles, no import from a lower layer up to a higher
one, no source file over MAX_LINES, no history in the code. Imports inside functions count: a lazy
import is still a dependency."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400

# Lowest first. A module may import from its own layer and the layers below it; within a layer
# the circle check keeps the order honest.
LAYERS: list[tuple[str, ...]] = [
    ("cluster.torch_extras", "cluster.protocol", "cluster.core.retry"),
    ("cluster.models", "cluster.config"),
    ("cluster.telemetry",),
    ("cluster.core.generation", "cluster.core.messages", "cluster.core.mcp", "cluster.core.events",
     "cluster.core.replay"),
    ("cluster.core.render",),
    ("cluster.core.safety",),
    ("cluster.core.turn",),
    ("cluster.core.websocket",),
    ("cluster.engines", "cluster.store", "cluster.serve_plugins"),
    ("cluster.auth", "cluster.serving"),
    ("actors",),
    ("cluster.app", "cluster.ingress", "cluster.cli",
     "cluster.bench", "cluster.__main__"),
]


def modules() -> dict[str, Path]:
    found = {}
    for top in ("cluster", "actors"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods] or [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target not in (name, "cluster"):
                    graph[name].add(target)
    return graph


def layer(name: str) -> int:
    best = (-1, -1)  # (prefix length, layer): the longest prefix decides
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                best = max(best, (len(prefix), i))
    assert best[1] >= 0, f"{name} is in no layer: add it to LAYERS"
    return best[1]


def circles(graph: dict[str, set[str]], names) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in names:
        if name not in index:
            visit(name)
    return found


def test_no_import_circles():
    mods = modules()
    assert circles(imports(mods), mods) == []


def test_no_import_from_a_lower_layer_up():
    mods = modules()
    graph = imports(mods)
    upward = sorted(f"{a} -> {b}" for a in mods if a != "cluster" for b in graph[a] if layer(b) > layer(a))
    assert upward == []


def test_no_source_file_over_max_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# An outside tracker's labels (an audit's finding, a stop's CI run, a commit) and dated runs say
# when a line was written, not why it is there: the why stays, the history is in docs/.
HISTORY = re.compile(r"audit[- ]?[0-9]|\bstop [0-9]+\b|\b[NF][0-9]{1,2}\b(?! =)|\((?:20[0-9]{2}-[0-9]{2}-[0-9]{2})\)"
                     r"|, 20[0-9]{2}-[0-9]{2}-[0-9]{2}\)|\bon 20[0-9]{2}-[0-9]{2}-[0-9]{2}")


def test_no_history_in_code_or_tests():
    files = [*modules().values(), *(ROOT / "tests").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert found == []


# Unit tests that check a property across modules rather than one module: they sit at the
# root of tests/unit, named for what they check.
CROSS_CUTTING = {"test_layout", "test_limits", "test_input_bounds", "test_protocol_doc", "test_infra",
                 "test_hot_path", "test_turn_path", "test_safety_coverage"}


def test_unit_tests_mirror_the_source_tree():
    """tests/unit/<path>/test_<name>.py tests cluster/<path>/<name>.py (actors/<name>.py under
    tests/unit/actors): a reader finds a module's tests where the module is, and its module where
    its tests are."""
    unit = ROOT / "tests" / "unit"
    strays = []
    for test in sorted(unit.rglob("test_*.py")):
        rel = test.relative_to(unit)
        name = rel.stem.removeprefix("test_")
        if len(rel.parts) == 1 and rel.stem in CROSS_CUTTING:
            continue
        top, *sub = rel.parent.parts or ("",)
        source = (ROOT / "actors" / f"{name}.py") if top == "actors" else \
            ROOT.joinpath("cluster", *([top] if top else []), *sub, f"{name}.py")
        if not source.exists():
            strays.append(f"{rel} (no {source.relative_to(ROOT)})")
    assert strays == []
