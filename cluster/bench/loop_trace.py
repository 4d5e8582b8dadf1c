"""Where a replica's event loop was busy without a break, from a py-spy timeline.

`py-spy record --format chrometrace --idle --threads` keeps every sample in time order (a frame
open across consecutive samples is one begin/end pair). The loop's thread runs one callback at a
time under uvloop, so the frames just under `Thread.run` are callbacks; a *busy run* is a stretch
with callbacks back to back (gaps under `gap_s`). Every socket of the replica waits through the
longest of them: they are the tail, named by what ran in them. Sampled stacks taken by a watchdog
when a stall is noticed only show what held the GIL at that moment; the timeline shows the whole
stretch.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

OWN = ("/cluster/", "/actors/")


def _spans(events: list[dict[str, Any]]) -> list[tuple[int, str, str, int, int]]:
    """(depth, frame name, file:line, begin us, end us) of one thread's begin/end events."""
    stack: list[dict[str, Any]] = []
    spans = []
    for e in events:
        if e["ph"] == "B":
            stack.append(e)
        elif stack:
            b = stack.pop()
            where = f"{b['args'].get('filename', '')}:{b['args'].get('line')}"
            spans.append((len(stack), b["name"], where, b["ts"], e["ts"]))
    return spans


def busy_runs(trace: Path, top: int = 8, gap_s: float = 0.015) -> dict[str, Any]:
    """The busiest thread's (the event loop's) longest busy runs: when, how long, and the
    callbacks and own frames that took their time."""
    events = json.loads(trace.read_text())
    if not events:
        return {"runs": []}
    thread = Counter(e["tid"] for e in events).most_common(1)[0][0]
    spans = _spans([e for e in events if e["tid"] == thread])
    depth = 1 + next((d for d, name, *_ in spans if name == "Thread.run"), 3)  # callbacks: just under it
    callbacks = sorted((s for s in spans if s[0] == depth), key=lambda s: s[3])
    runs: list[list[Any]] = []
    for s in callbacks:
        if runs and s[3] - runs[-1][1] < gap_s * 1e6:
            runs[-1][1] = max(runs[-1][1], s[4])
            runs[-1][2].append(s)
        else:
            runs.append([s[3], s[4], [s]])
    start = min(s[3] for s in spans)
    longest = sorted(runs, key=lambda r: r[0] - r[1])[:top]
    out = []
    for begin, end, members in longest:
        by_callback: Counter[str] = Counter()
        for s in members:
            by_callback[s[1]] += s[4] - s[3]
        own: Counter[str] = Counter()
        for d, name, where, b, e in spans:
            if d > depth and begin <= b and e <= end and any(part in where for part in OWN):
                own[f"{name} ({where.split('/')[-1]})"] += e - b
        out.append({"at_s": round((begin - start) / 1e6, 2), "ms": round((end - begin) / 1e3),
                    "callbacks_ms": {k: round(v / 1e3) for k, v in by_callback.most_common(4)},
                    "own_frames_ms": {k: round(v / 1e3) for k, v in own.most_common(6)}})
    busy = sum(r[1] - r[0] for r in runs) / 1e6
    return {"busy_s": round(busy, 2), "runs_over_100ms": sum(1 for r in runs if r[1] - r[0] > 1e5), "runs": out}
