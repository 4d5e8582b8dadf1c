"""When the KV budget ends retention early (cluster/engines/kv/eviction.py, with the rules of
kv/budget.py): beside a tier below the engine; pure logic on a fake clock."""

import pytest

from cluster.engines.kv.budget import BudgetPolicy, KvBudget


def budget(capacity=1000, **policy) -> KvBudget:
    return KvBudget(capacity, BudgetPolicy(**policy))


def test_with_a_lower_tier_an_ended_retention_costs_only_its_copy_back_so_a_turn_waits_that_long():
    # A CPU-like engine that is busy would let the turn wait max_queue_wait_s (60 s) for the
    # retained prefix; with a tier below, ending that retention costs 400 tokens at 100,000/s.
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60,
               compute_bound=True, lower_tier_tokens_per_s=100_000)
    b.observe_prefill(1_000, 1.0)
    t, _ = b.request("a", 600, 0)
    b.finish(t, held=600, expect_back=True, now=1)
    b.request("r", 100, 1)
    head, admitted = b.request("b", 700, 2)
    assert head not in admitted and b.next_deadline() == pytest.approx(2.004)
    assert b.tick(now=2.01) == [head] and b.counters.evicted == 1
