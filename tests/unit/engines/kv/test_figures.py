"""What a KV budget reads out (cluster/engines/kv/figures.py): totals, autoscaling demand, snapshot."""

import pytest

from cluster.engines.kv.budget import BudgetPolicy, KvBudget
from tests.unit.engines.kv.test_budget import budget, req


def test_demand_counts_running_retained_and_queued_tokens():
    b = budget(1000)
    t1, _ = req(b, "a", 400, now=0)
    t2, _ = req(b, "b", 300, now=0)
    b.finish(t2, held=300, expect_back=True, now=1)
    req(b, "c", 800, now=1)
    assert b.demand() == (400 + 300 + 800) / 1000
    assert b.headroom() == 1000 - 700 - 800


def test_retention_beyond_a_tenant_s_fair_share_does_not_drive_autoscaling():
    budget = KvBudget(10_000, BudgetPolicy(retention=True, ttl_initial_s=600.0, max_queue_wait_s=60.0))
    for i in range(9):
        t, _ = budget.request(f"a{i}", 1_000, float(i), tenant="A")
        budget.finish(t, 1_000, expect_back=True, now=float(i))
    t, _ = budget.request("b0", 500, 10.0, tenant="B")
    budget.finish(t, 500, expect_back=True, now=10.0)
    # two tenants: each counts up to half the capacity; A's 9,000 retained count as 5,000
    assert budget.demand() == pytest.approx((5_000 + 500) / 10_000)


def test_the_snapshot_shows_the_turn_time_and_whether_new_sessions_wait_for_waves():
    """An operator reading `stats` sees why new sessions wait or not: the turn time the wave rule
    compares a re-prefill against, and the rule's answer at the measured prefill rate."""
    b = budget(100_000, retention=True)
    assert b.snapshot(0)["waves"] == 1 and b.snapshot(0)["turn_s"] == 0  # nothing measured: waves
    b.prefill.observe(20_000, 1.0)  # 20,000 tokens/s: a GPU-like engine
    b.shape.observe_end(10_000)  # sessions end at 10k tokens: 0.5 s to compute again
    b.shape.observe_turn(2.0, 1.0)  # a turn takes 2 s: a re-prefill costs less than a turn
    snap = b.snapshot(0)
    assert snap["turn_s"] == pytest.approx(2.0) and snap["waves"] == 0
    b.shape.observe_end(60_000)  # 3 s to compute again: more than a turn
    assert b.snapshot(0)["waves"] == 1
