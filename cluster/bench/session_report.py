"""The many-sessions benchmark's figures: per-run summary, the table, and an SVG plot against N."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from cluster.bench.agent_loop import percentile


def summarize(rows: Iterable[Any], turns: int, elapsed: float) -> dict[str, Any]:
    """hit = cached / (previous input + output) per turn; late = the second half of the turns."""
    by_session: dict[int, list[Any]] = defaultdict(list)
    for r in rows:
        by_session[r.session].append(r)
    hits, late_hits = [], []
    reusable = cached = late_reusable = late_cached = 0
    prefilled = necessary = 0
    errors = 0
    for session_rows in by_session.values():
        session_rows.sort(key=lambda r: r.turn)
        prev = None
        for r in session_rows:
            if r.status == "error":
                errors += 1
                prev = None
                continue
            prefilled += r.input_tokens - r.cached_tokens
            if prev is None:
                necessary += r.input_tokens
            else:
                reuse = prev.input_tokens + prev.output_tokens
                necessary += max(0, r.input_tokens - reuse)
                got = min(r.cached_tokens, reuse)
                reusable += reuse
                cached += got
                hits.append(got / reuse if reuse else 1.0)
                if r.turn > turns / 2:
                    late_reusable += reuse
                    late_cached += got
                    late_hits.append(got / reuse if reuse else 1.0)
            prev = r
    # Sessions alive at once (first turn sent .. last turn answered): what the KV must hold
    # together, whatever the run's N.
    edges = sorted(e for rs in by_session.values() if rs
                   for e in ((rs[0].sent_at, 1), (rs[-1].sent_at + rs[-1].latency_s, -1)))
    live = peak = 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    rows = [r for rs in by_session.values() for r in rs]
    lat = [r.latency_s for r in rows if r.status != "error"]
    seen = [r.queued_s for r in rows if r.queued_s is not None]  # none over plain HTTP: not 0, unknown
    queued = [q for q in seen if q > 0]
    return {
        "hit": round(cached / reusable, 3) if reusable else None,
        "hit_late": round(late_cached / late_reusable, 3) if late_reusable else None,
        "prefilled_tokens": prefilled, "necessary_tokens": necessary,
        "prefill_ratio": round(prefilled / necessary, 2) if necessary else None,
        # The mean beside p50/p99: in a closed loop (each session waits for its answer) the mean
        # follows the engine's throughput, while the sessions' turns move in waves that shift the p50.
        "turn_mean_s": round(statistics.fmean(lat), 2) if lat else None,
        "turn_p50_s": round(percentile(lat, 50), 2), "turn_p99_s": round(percentile(lat, 99), 2),
        "client_queued_turns": len(queued) if seen else None,
        "client_max_queue_wait_s": round(max(queued, default=0.0), 2) if seen else None,
        "all_done_s": round(elapsed, 1), "turns": len(lat), "errors": errors, "peak_live_sessions": peak,
        # Goodput: what the clients got done per second of the run (answered turns, their output tokens).
        "goodput_turns_per_s": round(len(lat) / elapsed, 2) if elapsed > 0 else None,
        "goodput_output_tokens_per_s": round(sum(r.output_tokens for r in rows if r.status != "error") / elapsed, 1)
        if elapsed > 0 else None,
    }


COLUMNS = [("system", "system", "{}"), ("N", "sessions", "{}"), ("hit", "hit", "{}"), ("late", "hit_late", "{}"),
           ("prefilled/necessary", "prefill_ratio", "{}x"), ("preempt", "preemptions", "{}"),
           ("mean s", "turn_mean_s", "{}"), ("p50 s", "turn_p50_s", "{}"), ("p99 s", "turn_p99_s", "{}"),
           ("done s", "all_done_s", "{}"), ("goodput turns/s", "goodput_turns_per_s", "{}"),
           ("max queue s", "client_max_queue_wait_s", "{}"), ("errors", "errors", "{}")]


def table(results: list[dict[str, Any]]) -> str:
    head = " | ".join(c[0] for c in COLUMNS)
    lines = [head, " | ".join("---" for _ in COLUMNS)]
    for r in results:
        lines.append(" | ".join(fmt.format(r.get(key)) if r.get(key) is not None else "-" for _, key, fmt in COLUMNS))
    return "\n".join(lines)


CALIBRATION_TOLERANCE = 0.10  # the stand-in's hit within ±10% of vLLM's, at every N


def calibrate(results: list[dict[str, Any]], reference: str = "vllm", stand_in: str = "stand-in") -> list[dict[str, Any]]:
    """The scripted engine's modelled KV against the real engine, per N of one run: hit and late
    hit side by side, the relative gap, and whether it is within the tolerance."""
    ref = {r["sessions"]: r for r in results if r["system"] == reference}
    rows = []
    for r in results:
        if r["system"] != stand_in or r["sessions"] not in ref:
            continue
        v = ref[r["sessions"]]
        gap = (r["hit"] - v["hit"]) / v["hit"] if r.get("hit") is not None and v.get("hit") else None
        rows.append({"sessions": r["sessions"], "vllm_hit": v.get("hit"), "stand_in_hit": r.get("hit"),
                     "vllm_hit_late": v.get("hit_late"), "stand_in_hit_late": r.get("hit_late"),
                     "gap": round(gap, 3) if gap is not None else None,
                     "within": gap is not None and abs(gap) <= CALIBRATION_TOLERANCE})
    return rows


def calibration_table(rows: list[dict[str, Any]]) -> str:
    lines = ["N | vLLM hit | stand-in hit | vLLM late | stand-in late | gap | within ±10%", "---|---|---|---|---|---|---"]
    for c in rows:
        gap = f"{c['gap']:+.1%}" if c["gap"] is not None else "-"
        lines.append(f"{c['sessions']} | {c['vllm_hit']} | {c['stand_in_hit']} | {c['vllm_hit_late']} | "
                     f"{c['stand_in_hit_late']} | {gap} | {'yes' if c['within'] else 'no'}")
    return "\n".join(lines)


def plot_svg(results: list[dict[str, Any]], path: Path) -> Path:
    """Two panels, hit and turn p50 latency against N, one line per system (no plotting library)."""
    systems = sorted({r["system"] for r in results})
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    ns = sorted({r["sessions"] for r in results})
    w, h, pad = 360, 240, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w + 40}" height="{h + 70}" '
             'font-family="sans-serif" font-size="11">']
    for panel, (key, label) in enumerate([("hit", "hit (cached / reusable)"), ("turn_p50_s", "turn p50 (s)")]):
        x0 = 20 + panel * (w + 20)
        values = [r.get(key) or 0 for r in results]
        top = 1.0 if key == "hit" else max(values + [1e-9]) * 1.1
        parts.append(f'<text x="{x0 + w / 2}" y="14" text-anchor="middle">{label} vs N</text>')
        parts.append(f'<rect x="{x0 + pad}" y="20" width="{w - pad - 10}" height="{h - 40}" fill="none" stroke="#999"/>')

        def xy(n: int, v: float) -> tuple[float, float]:
            i = ns.index(n)
            x = x0 + pad + (i + 0.5) * (w - pad - 10) / len(ns)
            return x, 20 + (h - 40) * (1 - v / top)

        for n in ns:
            x, _ = xy(n, 0)
            parts.append(f'<text x="{x}" y="{h - 5}" text-anchor="middle">N={n}</text>')
        parts.append(f'<text x="{x0 + pad - 4}" y="24" text-anchor="end">{top:.2g}</text>')
        parts.append(f'<text x="{x0 + pad - 4}" y="{h - 20}" text-anchor="end">0</text>')
        for si, system in enumerate(systems):
            pts = [xy(r["sessions"], r.get(key) or 0) for r in sorted(results, key=lambda r: r["sessions"])
                   if r["system"] == system]
            color = colors[si % len(colors)]
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                         + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
            for x, y in pts:
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
    for si, system in enumerate(systems):
        parts.append(f'<text x="{20 + si * 150}" y="{h + 40}" fill="{colors[si % len(colors)]}">{system}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))
    return path


def median_of_rounds(per_round: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per system and N: the median of each number over its rounds (`--rounds`); the
    rounds' own p50s and done times ride along, so the spread stays visible."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in per_round:
        groups[(r["system"], r["sessions"])].append(r)
    merged = []
    for (system, n), runs in groups.items():
        row: dict[str, Any] = {"system": system, "sessions": n, "rounds": len(runs)}
        for key in runs[0]:
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
            if key not in row and key != "round" and len(values) == len(runs):
                mid = statistics.median(values)
                row[key] = int(mid) if all(isinstance(v, int) for v in values) and mid == int(mid) else round(mid, 3)
        row["round_p50_s"] = [r.get("turn_p50_s") for r in runs]
        row["round_done_s"] = [r.get("all_done_s") for r in runs]
        merged.append(row)
    return merged
