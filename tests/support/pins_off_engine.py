"""The real vLLM engine, told by its retention guard that the installed vLLM is a release outside
the tested range. A named fake of one fact only (the version the guard reads: 0.99.0 stands in
for a future vLLM whose scheduler internals may have moved); the guard's own rule decides, and
the engine, its scheduler and the KV budget are the real ones."""

from typing import Optional

from cluster.engines.vllm.engine import VLLMEngine

FUTURE_VLLM = "0.99.0"


class VLLMEngineOnUntestedVersion(VLLMEngine):
    def retention_check(self) -> Optional[str]:
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler

        from cluster.engines.vllm.retention_guard import unsupported_reason

        return unsupported_reason(FUTURE_VLLM, {"Scheduler": Scheduler, "KVCacheManager": KVCacheManager,
                                                "BlockPool": BlockPool})
