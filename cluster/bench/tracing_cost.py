"""What tracing costs a turn: the same WebSocket agent loop on two apps, telemetry on vs off.

    python -m cluster.bench.tracing_cost --turns 30 --rounds 3

Both apps run in one local cluster (scripted engine); the `on` app exports every
span and metric over OTLP/HTTP to a receiver in this process (sample ratio 1).
Rounds alternate on/off so machine noise hits both. Prints per-turn server
overhead (turn time minus engine time, the server's own timing) p50/p99 and
the ratio, and how many spans arrived.
"""

from __future__ import annotations

import argparse
import asyncio

from cluster.bench.agent_loop import Loop, attach_server_timings, percentile
from cluster.bench.local import deploy, start_local_serve, stop_local_serve
from cluster.bench.runner import SCRIPTED


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="loopserve bench tracing-cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args(argv)
    from tests.otlp_receiver import OtlpHttpReceiver

    base = start_local_serve()
    with OtlpHttpReceiver() as receiver:
        try:
            common = {"engine": {"backend": "scripted", "scripted": SCRIPTED}, "store": {"backend": "none"},
                      "model": {"max_model_len": 262144}}
            urls = {
                "off": deploy(base, "off", "/off", common),
                "on": deploy(base, "on", "/on", {**common, "telemetry": {
                    "enabled": True, "protocol": "http", "endpoint": receiver.url}}),
            }
            overhead: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(ns.rounds):
                for mode in ("off", "on"):
                    turns = asyncio.run(Loop(urls[mode], "websocket", ns.turns, 2000).run())
                    attach_server_timings(urls[mode], turns)
                    overhead[mode] += [t.overhead_s * 1000 for t in turns[1:] if t.overhead_s is not None]
        finally:
            stop_local_serve()
        spans = len(receiver.spans)
    p = {m: (percentile(v, 50), percentile(v, 99)) for m, v in overhead.items()}
    print(f"\nWebSocket turn overhead, {ns.rounds} x {ns.turns} turns per app, same cluster, alternating:")
    for m in ("off", "on"):
        print(f"  telemetry {m:3s}: p50 {p[m][0]:.2f} ms  p99 {p[m][1]:.2f} ms")
    print(f"  on/off: p50 {p['on'][0] / p['off'][0]:.2f}x, p99 {p['on'][1] / p['off'][1]:.2f}x; "
          f"{spans} spans received ({spans / max(1, ns.rounds * ns.turns):.1f} per turn)")


if __name__ == "__main__":
    main()
