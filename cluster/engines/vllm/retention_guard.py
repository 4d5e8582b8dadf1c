"""Whether vLLM's internals that session pins ride on are there (`vllm/retention.py`).

The retaining scheduler overrides private methods of vLLM's scheduler and calls private parts of
its KV cache manager and block pool. Those were read from vLLM 0.32 (`TESTED_VLLM`); on another
version they may be gone or mean something else, and pins could silently stop (or worse, leak
blocks). The engine checks before loading the scheduler: a vLLM outside the range, or one missing
any of these, runs without pins, with the reason logged and `pins_enabled` 0 in its stats and
metrics. Plain logic; the vLLM classes are passed in (`check_installed` imports them).
"""

from __future__ import annotations

from typing import Any, Optional

# The vLLM versions whose scheduler internals the retaining scheduler was written against.
TESTED_VLLM = ((0, 32), (0, 33))  # [0.32, 0.33)

# (class role, attribute) the retaining scheduler overrides or calls.
REQUIRED = (
    ("Scheduler", "add_request"),
    ("Scheduler", "schedule"),
    ("Scheduler", "finish_requests"),
    ("Scheduler", "reset_prefix_cache"),
    ("Scheduler", "_free_request_blocks"),
    ("Scheduler", "_preempt_request"),
    ("KVCacheManager", "allocate_slots"),
    ("KVCacheManager", "get_blocks"),
    ("BlockPool", "touch"),
    ("BlockPool", "free_blocks"),
)


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.32.0+cpu" -> (0, 32, 0); "0.33.1rc1" -> (0, 33, 1): each part's leading digits, up to
    the first part without any."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = part[:len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def unsupported_reason(version: str, classes: dict[str, Any]) -> Optional[str]:
    """None when pins can run on this vLLM; else why not (for the log and the stats)."""
    low, high = TESTED_VLLM
    v = version_tuple(version)
    if not (low <= v[:2] < high):
        return (f"vLLM {version} is outside the range session pins were tested on "
                f"({'.'.join(map(str, low))} <= v < {'.'.join(map(str, high))})")
    missing = [f"{role}.{attr}" for role, attr in REQUIRED
               if classes.get(role) is None or not callable(getattr(classes[role], attr, None))]
    if missing:
        return f"vLLM {version} lacks what session pins use: {', '.join(missing)}"
    return None


def check_installed() -> Optional[str]:
    """`unsupported_reason` for the installed vLLM."""
    try:
        import vllm
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception as exc:  # noqa: BLE001 - a moved module is exactly what this guards against
        return f"vLLM's scheduler internals cannot be imported: {type(exc).__name__}: {str(exc)[:200]}"
    return unsupported_reason(getattr(vllm, "__version__", "0"),
                              {"Scheduler": Scheduler, "KVCacheManager": KVCacheManager, "BlockPool": BlockPool})
