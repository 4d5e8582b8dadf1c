"""Engine autoscaling when turns bypass Serve's handle, on requests and on KV demand.

With direct engine streams (`engine.direct_stream`), only a session's first turn is a
Serve request, so Serve's own count of ongoing requests per engine replica misses most
of the load. Each engine replica reports what it is really running (`in_flight`, handle
and channel requests alike) and its KV demand (running + retained + queued tokens over
its capacity, and how long its oldest waiting turn has waited;
`EngineReplica.record_autoscaling_stats`). The policy asks for enough replicas for the
larger of the two loads:
- requests: in flight / target per replica (Serve's own rule, on the engines' count);
- KV: the summed demand over `KV_TARGET` of a replica (a replica whose KV is full of
  retained sessions is as busy as one full of running turns: their next turns are due),
  one more while a turn has waited longer than `KV_WAIT_S` for room.
Retained tokens keep the demand up until their sessions' TTLs end, so scaling down waits
for retention to expire (plus Serve's downscale delay). Serve wraps a custom policy with
the deployment's min/max replicas, scaling factors and delays.
"""

from __future__ import annotations

import math
from typing import Any

KV_TARGET = 0.9  # of a replica's KV capacity
KV_WAIT_S = 5.0  # a turn waiting longer than this for room asks for one more replica


def engine_in_flight_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Desired replicas for the engine deployment (never below what Serve itself sees)."""
    replicas = ctx.current_num_replicas
    if replicas == 0:
        return ctx.target_num_replicas, {}
    metrics = ctx.aggregated_metrics or {}
    reported = metrics.get("in_flight") or {}
    load = max(float(sum(reported.values())), float(ctx.total_num_requests or 0))
    desired = load / ctx.config.get_target_ongoing_requests()
    demand = metrics.get("kv_demand") or {}
    if demand:
        kv = sum(float(v) for v in demand.values()) / KV_TARGET
        waits = metrics.get("kv_head_wait_s") or {}
        if max((float(v) for v in waits.values()), default=0.0) > KV_WAIT_S:
            kv = max(kv, replicas + 1)
        desired = max(desired, math.ceil(kv * 100) / 100)
    return desired, {}
