"""`loopserve bench kv-grid`: the KV policy judged at every engine speed, in one command.

    loopserve bench kv-grid                                    # cpu, h100-8b, h100-8b-long; 3 rounds
    loopserve bench kv-grid --models h100-8b --rounds 1 --sessions 32

For each engine model (the scripted engine running `engine.scripted.preset`'s step times) and
round, `sessions` runs the same agent sessions (a function call answered every turn) over every
transport (WebSocket held, a WebSocket a turn, HTTP chained), with the KV policy on
(`loopserve`) and off (`loopserve-nobudget`), on and off alternating which goes first. Per cell
(model x transport x policy): the median of all-done seconds, hit, prefilled tokens and p99 turn
over the rounds, on/off as a ratio with the worst round's ratio to its partner, and the lower bound:
the necessary prefill (each turn's new tokens after the context before it, at the model's step
times) plus the output's decode, spread over the engine replicas. `--long` contexts (30-120k
tokens) are `h100-8b-long`'s: its turns add 12,000 characters. Each transport runs on a deployment
of its own, started afresh: a replica learns how large and how long its sessions run as it serves
them, and one deployment serving the transports in turn gave the first the least (it met a replica
that had learned nothing; the others met one the first had taught), whichever transport it was.
Each round's hit spread across transports is printed per policy. Writes `kv_grid.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

TRANSPORTS = "ws,ws-reconnect,http"
# model -> (characters a turn adds, KV tokens a replica): pools that the sessions' final contexts
# oversubscribe, so the policy has something to decide. h100-8b-long: 32 sessions end at ~33k tokens
# (~1.06M) against 4 x 100k; at 200k a replica no policy already cached 92-100% of the prompt.
SHAPES = {"cpu": (2000, 12_000), "h100-8b": (2000, 24_000), "h100-8b-long": (12_000, 100_000)}


def lower_bound(model: str, row: dict[str, Any], sessions: int, turns: int, output_tokens: int,
                replicas: int) -> float:
    """The least engine time the cell's work takes: necessary prefill and decode, on all replicas."""
    from cluster.engines.scripted.cost_model import PRESETS

    m = PRESETS[model]
    per_turn = row["necessary_tokens"] / max(1, row["turns"])
    prefill = sum(m.prefill_time(int(per_turn), int(per_turn * t)) for t in range(turns)) * sessions
    decode = output_tokens * turns * m.decode_step(max(1, sessions // replicas), int(per_turn * turns / 2))
    return prefill / replicas + decode


def main(argv=None) -> int:
    from cluster.bench import sessions as bench_sessions

    ap = argparse.ArgumentParser(prog="loopserve bench kv-grid", description=__doc__)
    ap.add_argument("--models", default="cpu,h100-8b,h100-8b-long")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--transports", default=TRANSPORTS)
    ap.add_argument("--out", default="bench_out/kv_grid")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    rows: list[dict[str, Any]] = []
    for model, rnd, transport, systems in runs(ns.models, ns.rounds, ns.transports):
        chars, kv = SHAPES[model]
        run_dir = out / f"{model}-{rnd}-{transport}"
        bench_sessions.main(["--engine", "scripted", "--engine-model", model, "--kv-tokens", str(kv),
                             "--sessions", str(ns.sessions), "--turns", str(ns.turns), "--turn-chars", str(chars),
                             "--replicas", str(ns.replicas), "--connections", "2", "--shape", "agent",
                             "--transports", transport, "--systems", systems, "--out", str(run_dir)])
        report = json.loads((run_dir / "sessions.json").read_text())
        output_tokens = report["workload"].get("output_tokens", 16)
        for r in report["per_round"]:
            system = r["system"].split("/")[0]
            rows.append({"model": model, "round": rnd, "policy": system == "loopserve", "transport": transport,
                         **{k: r[k] for k in ("all_done_s", "hit", "prefilled_tokens", "turn_p99_s")},
                         "lower_bound_s": round(lower_bound(model, r, ns.sessions, ns.turns + 1, output_tokens,
                                                            ns.replicas), 2)})
        # after each run: a grid cut short (its time limit) keeps the runs it finished
        (out / "kv_grid.json").write_text(json.dumps(rows, indent=1))
        print(table(rows) + "\n\n" + spreads(rows), flush=True)
    return 0


def runs(models: str, rounds: int, transports: str) -> list[tuple[str, int, str, str]]:
    """(model, round, transport, systems) per `sessions` run, each on deployments of its own: per
    round the transports rotate which goes first and the policy alternates which of on and off
    does (the machine's drift falls on all alike)."""
    plan = []
    for model in models.split(","):
        for rnd in range(rounds):
            systems = "loopserve,loopserve-nobudget" if rnd % 2 == 0 else "loopserve-nobudget,loopserve"
            names = transports.split(",")
            k = rnd % len(names)
            plan += [(model, rnd, t, systems) for t in names[k:] + names[:k]]
    return plan


def spreads(rows: list[dict[str, Any]]) -> str:
    """Per model, round and policy: the hit of each transport and the spread (highest - lowest).
    The policy-off spread is what the bench itself varies by, with no policy to differ."""
    lines = ["model | round | policy | hit by transport | spread", "---|---|---|---|---"]
    for model, rnd, policy in sorted({(r["model"], r["round"], r["policy"]) for r in rows}):
        hits = {r["transport"]: r["hit"] for r in rows if (r["model"], r["round"], r["policy"]) == (model, rnd, policy)}
        shown = " / ".join(f"{t} {h:.3f}" for t, h in sorted(hits.items()))
        lines.append(f"{model} | {rnd} | {'on' if policy else 'off'} | {shown} | "
                     f"{max(hits.values()) - min(hits.values()):.3f}")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["model | transport | done s on / off (median) | on/off | worst round on/off | hit on / off | "
             "prefilled on / off | p99 on / off | lower bound s", "---|---|---|---|---|---|---|---|---"]
    cells = sorted({(r["model"], r["transport"]) for r in rows})
    for model, transport in cells:
        on = [r for r in rows if (r["model"], r["transport"], r["policy"]) == (model, transport, True)]
        off = [r for r in rows if (r["model"], r["transport"], r["policy"]) == (model, transport, False)]
        if not on or not off:
            continue

        def med(rs, k):
            return statistics.median(r[k] for r in rs)

        pairs = [a["all_done_s"] / b["all_done_s"] for a in on for b in off if a["round"] == b["round"]]
        lines.append(f"{model} | {transport} | {med(on, 'all_done_s'):.1f} / {med(off, 'all_done_s'):.1f} | "
                     f"{med(on, 'all_done_s') / med(off, 'all_done_s'):.2f} | {max(pairs):.2f} | "
                     f"{med(on, 'hit'):.3f} / {med(off, 'hit'):.3f} | "
                     f"{med(on, 'prefilled_tokens'):.0f} / {med(off, 'prefilled_tokens'):.0f} | "
                     f"{med(on, 'turn_p99_s'):.2f} / {med(off, 'turn_p99_s'):.2f} | {med(on, 'lower_bound_s'):.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
