"""Engine autoscaling when turns bypass Serve's handle.

With direct engine streams (`engine.direct_stream`), only a session's first turn is a
Serve request, so Serve's own count of ongoing requests per engine replica misses most
of the load. Each engine replica reports what it is really running (`in_flight`, handle
and channel requests alike; `EngineReplica.record_autoscaling_stats`), and this policy
scales on it exactly like Serve's default scales on ongoing requests. Serve wraps a
custom policy with the deployment's min/max replicas, scaling factors and delays.
"""

from __future__ import annotations

from typing import Any


def engine_in_flight_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Desired replicas = requests in the engines / target per replica (Serve's rule, on
    the engines' own count; never below what Serve itself sees)."""
    replicas = ctx.current_num_replicas
    if replicas == 0:
        return ctx.target_num_replicas, {}
    reported = (ctx.aggregated_metrics or {}).get("in_flight") or {}
    load = max(float(sum(reported.values())), float(ctx.total_num_requests or 0))
    return load / ctx.config.get_target_ongoing_requests(), {}
