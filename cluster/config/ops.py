"""`ops`: routes for operators and benchmarks, off the public API."""

from __future__ import annotations

from cluster.config.base import StrictModel


class OpsConfig(StrictModel):
    """Routes for operators and benchmarks, off the public API."""

    echo_route: bool = False
    """`/loopserve/echo`: a WebSocket echo through the same ingress, the latency floor the benchmark compares with.
    Benchmark-only: off unless turned on, and even then it needs an admin key and obeys the WebSocket limits."""
    prompt_text_digests: bool = False
    """Tests and debugging: engine replicas also keep a digest of each prompt's text (decoded, O(prompt) after each
    turn), to check prompts that reuse generated tokens against a full render (their token ids legitimately
    differ from a re-tokenization)."""

