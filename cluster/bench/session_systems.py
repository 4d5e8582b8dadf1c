"""The loopserve systems of `cluster.bench.sessions`: their app args from a serve config, a
local cluster serving them, and their engines' KV counters (the peers are in `peers.py`)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

# The scripted engine's modelled KV cache without loopserve's budget (hash placement, no
# retention: what vLLM does alone), run at the real engine's KV size and this CPU's rates.
STAND_IN = "stand-in"
# vLLM's server with an idle loopserve cluster (scripted engine) beside it on the machine.
BESIDE_RAY = "vllm-beside-ray"


def loopserve_args(config_path: str, engine: str, replicas: int, kv_tokens: Optional[int], budget: bool,
                   rates: tuple[float, float], kv_blocks: Optional[int] = None, sessions: int = 0, *,
                   connections: int = 1, store_dir: Optional[str] = None,
                   serial_prefill: bool = True, lower_tier: float = 0.0,
                   engine_model: Optional[str] = None) -> dict[str, Any]:
    """`store_dir`: a fresh SQLite store there (chains over HTTP or new sockets, on any connection
    replica); None: no store (`store: false` WebSocket sessions). `lower_tier`: the scripted engine's
    modelled tier below its KV, this many times the KV (0: none). `engine_model`: the scripted engine
    runs that engine model's steps (`engine.scripted.preset`) instead of `rates`, with its KV pool
    unless `kv_tokens` is given."""
    import yaml

    args = yaml.safe_load(Path(config_path).read_text())["applications"][0]["args"]
    args.setdefault("engine", {})
    if kv_blocks:
        args["engine"].setdefault("vllm", {})["num_gpu_blocks_override"] = kv_blocks
    args["engine"]["kv_budget"] = {**args["engine"].get("kv_budget", {}), "enabled": budget}
    if store_dir:
        import time

        args["store"] = {"backend": "sqlite", "sqlite_path": str(Path(store_dir) / f"responses-{time.time_ns()}.sqlite3")}
    else:
        args["store"] = {"backend": "none"}  # store: false sessions; the bench measures the engine path
    args.setdefault("engine_deployment", {})["num_replicas"] = replicas
    conn = args.setdefault("connection", {})
    conn["num_replicas"] = connections
    # Every session's socket open at once on the connection replica(s).
    conn["max_ongoing_requests"] = max(conn.get("max_ongoing_requests", 256), sessions + 16)
    if engine == "scripted":
        args["engine"]["backend"] = "scripted"
        args["engine"]["scripted"] = {"kv_capacity_tokens": kv_tokens or 46_592, "kv_block_size": 32,
                                      "prefill_tokens_per_second": rates[0], "tokens_per_second": rates[1],
                                      "max_output_tokens": 64, "serial_prefill": serial_prefill,
                                      "answer_text": "I ran the tool and read its output; next I will fix the failing test. " * 3}
        if engine_model:
            from cluster.engines.scripted.cost_model import PRESETS

            args["engine"]["scripted"].update(preset=engine_model, serial_prefill=False,
                                              kv_capacity_tokens=kv_tokens or PRESETS[engine_model].kv_capacity_tokens)
            # the named model's context: h100-8b-long's sessions outgrow the config's model (8k)
            args.setdefault("model", {})["max_model_len"] = PRESETS[engine_model].max_model_len
        if lower_tier:
            args["engine"]["scripted"]["kv_lower_tier_tokens"] = int(lower_tier * (kv_tokens or 46_592))
        args["engine_deployment"].setdefault("ray_actor_options", {})["num_cpus"] = 0.1  # 4 replicas on a 4-CPU cluster
    return args


@contextmanager
def loopserve(args: dict[str, Any], ingress: str) -> Iterator[str]:
    from cluster.bench.local import deploy, start_local_serve, stop_local_serve

    url = deploy(start_local_serve(ingress=ingress), "sessions", "/", args, timeout=900)
    try:
        yield url
    finally:
        stop_local_serve()


def loopserve_engine_stats(url: str, probes: int = 32) -> list[dict[str, Any]]:
    """Every engine replica's `kv` figures (stats routed by session key: probe a few keys)."""
    from cluster.bench.local import stats

    seen: dict[str, dict[str, Any]] = {}
    for i in range(probes):
        engine = stats(url, session=f"probe-{i}")["engine"]
        seen[engine.get("replica", str(i))] = {**engine.get("kv", {}), "prompt_tokens": engine["prompt_tokens"],
                                               "cached_tokens": engine["cached_tokens"]}
    return list(seen.values())


def kill_engine_replica_after(delay_s: float, app: str = "sessions") -> threading.Timer:
    """An engine replica dies `delay_s` into the run (`ray.kill`, as a lost node would take it): its
    sessions must be placed again and counted, and no turn may be lost. The timer's `killed` names it."""
    timer: threading.Timer

    def kill() -> None:
        import ray

        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(f"SERVE_REPLICA::{app}#EngineReplica#"))
        if names:
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            timer.killed = names[0]  # type: ignore[attr-defined]

    timer = threading.Timer(delay_s, kill)
    timer.killed = ""  # type: ignore[attr-defined]
    timer.daemon = True
    timer.start()
    return timer


def loopserve_session_moves(url: str, probes: int = 32) -> int:
    """Sessions every connection replica saw move to another engine replica (summed over the
    processes that answered the probes)."""
    from cluster.bench.local import stats

    seen: dict[int, int] = {}
    for i in range(probes):
        s = stats(url, last=0, session=f"probe-{i}")
        seen[s["pid"]] = s.get("session_moves", 0)
    return sum(seen.values())
