"""The KV budget on an event loop (actors/kv_gate.py): waiting turns are futures, woken by every
change that admits them, including another turn's arrival; timers expire retention."""

import asyncio

from actors.kv_gate import KvGate, pin_key
from cluster.engines.kv_budget import BudgetPolicy


class FakeClock:  # a fake: the budget's time, moved by the test
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_waiter_let_in_by_another_turns_arrival_is_woken():
    clock = FakeClock()
    gate = KvGate(1000, BudgetPolicy(ttl_initial_s=5, max_queue_wait_s=100), clock)
    t1, wait = gate.request("a", 600)
    assert wait is None
    gate.finish(t1, 600, expect_back=True)  # retained until 5
    clock.now = 2
    t2, wait_b = gate.request("b", 600)
    assert wait_b is not None and not wait_b.done()
    clock.now = 7  # a's retention ran out; the timer has not fired yet, c's arrival notices
    t3, wait_c = gate.request("c", 300)
    assert wait_c is None
    await asyncio.wait_for(wait_b, 1)
    assert gate.take_unpins() == ("a",)


async def test_the_timer_expires_retention_and_lets_the_queue_in():
    gate = KvGate(1000, BudgetPolicy(ttl_initial_s=0.2, ttl_min_s=0.1, max_queue_wait_s=100))
    t1, _ = gate.request("a", 600)
    gate.finish(t1, 600, expect_back=True)
    t2, wait = gate.request("b", 600)
    assert wait is not None
    await asyncio.wait_for(wait, 2)  # no other event: the timer does it
    assert gate.snapshot()["expired"] == 1


async def test_a_turn_given_up_while_waiting_or_just_admitted_returns_its_tokens():
    gate = KvGate(1000, BudgetPolicy(max_queue_wait_s=100))
    t1, _ = gate.request("a", 800)
    t2, wait = gate.request("b", 800)
    gate.finish(t1, 800, expect_back=False)  # b admitted
    assert wait.done()
    gate.cancel(t2)  # ... but its client left before it ran
    assert gate.snapshot()["running_tokens"] == 0


def test_pin_keys_are_bounded_and_separate_tenants():
    assert len(pin_key("salt", "x" * 10_000)) == 24
    assert pin_key("t1", "s") != pin_key("t2", "s")


def test_tokens_are_counted_in_whole_engine_blocks():
    gate = KvGate(1000, BudgetPolicy(max_queue_wait_s=100), block_size=32)
    assert gate.budget.capacity == 992
    t1, _ = gate.request("a", 33)
    assert gate.snapshot()["running_tokens"] == 64
    gate.finish(t1, 65, expect_back=True)
    assert gate.snapshot()["retained_tokens"] == 96
