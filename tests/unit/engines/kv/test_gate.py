"""The KV budget on an event loop (cluster/engines/kv/gate.py): waiting turns are futures, woken by every
change that admits them, including another turn's arrival; timers expire retention."""

import asyncio
from array import array

from cluster.engines.kv.gate import KvGate, pin_key
from cluster.engines.kv.budget import BudgetPolicy


def prompt(seed: int, n: int) -> array:
    return array("i", [(seed * 1_000_003 + i) % 50_000 for i in range(n)])


class FakeClock:  # a fake: the budget's time, moved by the test
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_waiter_let_in_by_another_turns_arrival_is_woken():
    clock = FakeClock()
    gate = KvGate(1000, BudgetPolicy(ttl_initial_s=5, max_queue_wait_s=100), clock)
    t1, wait = gate.request("a", prompt(1, 600), 0)
    assert wait is None
    gate.finish(t1, 600, expect_back=True)  # retained until 5
    clock.now = 2
    t2, wait_b = gate.request("b", prompt(2, 600), 0)
    assert wait_b is not None and not wait_b.done()
    clock.now = 7  # a's retention ran out; the timer has not fired yet, c's arrival notices
    t3, wait_c = gate.request("c", prompt(3, 300), 0)
    assert wait_c is None
    await asyncio.wait_for(wait_b, 1)
    assert gate.take_unpins() == ("a",)


async def test_the_timer_expires_retention_and_lets_the_queue_in():
    gate = KvGate(1000, BudgetPolicy(ttl_initial_s=0.2, ttl_min_s=0.1, max_queue_wait_s=100))
    t1, _ = gate.request("a", prompt(1, 600), 0)
    gate.finish(t1, 600, expect_back=True)
    t2, wait = gate.request("b", prompt(2, 600), 0)
    assert wait is not None
    await asyncio.wait_for(wait, 2)  # no other event: the timer does it
    assert gate.snapshot()["expired"] == 1


async def test_a_turn_given_up_while_waiting_or_just_admitted_returns_its_tokens():
    gate = KvGate(1000, BudgetPolicy(max_queue_wait_s=100))
    t1, _ = gate.request("a", prompt(1, 800), 0)
    t2, wait = gate.request("b", prompt(2, 800), 0)
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
    t1, _ = gate.request("a", prompt(1, 33), 0)
    assert gate.snapshot()["running_tokens"] == 64
    gate.finish(t1, 65, expect_back=True)
    assert gate.snapshot()["retained_tokens"] == 96


def test_a_turn_reserves_the_output_its_session_produced_lately_not_its_whole_budget():
    gate = KvGate(10_000, BudgetPolicy(max_queue_wait_s=100), block_size=16)
    t, _ = gate.request("a", prompt(1, 160), 512)
    assert gate.snapshot()["running_tokens"] == 160 + 512  # nothing produced here yet: the full budget
    gate.finish(t, 160 + 40, expect_back=True, output_tokens=40)
    t, _ = gate.request("a", prompt(1, 240), 512)
    assert gate.snapshot()["running_tokens"] == 240 + 64  # 1.25 x 40 = 50, in whole blocks
    gate.finish(t, 240 + 8, expect_back=True, output_tokens=8)
    t, _ = gate.request("b", prompt(2, 160), 512)  # a new session: what this replica's turns made ...
    assert gate.snapshot()["running_tokens"] == 160 + 128  # max(8, 0.8 x 40) x 1.25 = 40, at least 512/4 = 128
    gate.cancel(t)
    t, _ = gate.request("c", prompt(3, 160), 30)  # never more than the turn may produce
    assert gate.snapshot()["running_tokens"] == 160 + 32


def test_sessions_sharing_their_tenants_head_count_it_once():
    gate = KvGate(10_000, BudgetPolicy(max_queue_wait_s=100), block_size=8)
    head = prompt(9, 800)  # instructions and tools every session of the tenant starts with
    sessions = {s: head + prompt(i, 200) for i, s in enumerate("abcd")}
    tickets = {s: gate.request(s, p, 0, tenant="t")[0] for s, p in sessions.items()}
    snap = gate.snapshot()
    assert snap["running_tokens"] == 4 * 1000
    # the tenant's head is a's first prompt (all but its last block): b, c, d share 800 of it
    assert snap["shared_tokens"] == 992 and gate.budget.used == 992 + 8 + 3 * 200
    for s, t in tickets.items():
        gate.finish(t, 1000, expect_back=True)
    assert gate.budget.used == 1600 and gate.snapshot()["retained_tokens"] == 4000
    other = gate.request("x", head + prompt(7, 200), 0, tenant="u")[0]  # another tenant: its own head
    assert gate.budget.used == 1600 + 1000
    gate.cancel(other)
    for s in "abcd":
        gate.release(s)
    assert gate.budget.used == 0 and gate.snapshot()["shared_tokens"] == 0


async def test_what_the_engine_holds_beyond_the_budget_is_not_given_out():
    gate = KvGate(1000, BudgetPolicy(max_queue_wait_s=100))
    t, _ = gate.request("a", prompt(1, 400), 0, engine_in_use=0)
    # the engine says 700 tokens are in use (a request the budget let go of, not freed yet)
    t2, wait = gate.request("b", prompt(2, 400), 0, engine_in_use=700)
    assert wait is not None and gate.snapshot()["engine_excess_tokens"] == 300
    gate.finish(t, 400, expect_back=False)
    assert wait.done()  # a's 400 went back: 400 + 300 fits now


async def test_blocks_the_engine_holds_only_until_a_pending_unpin_reaches_it_are_not_counted_as_excess():
    gate = KvGate(1000, BudgetPolicy(ttl_initial_s=5, max_queue_wait_s=100))
    t, _ = gate.request("a", prompt(1, 600), 0, engine_in_use=0)
    gate.finish(t, 600, expect_back=True)  # retained; the engine pins its 600 tokens
    gate.release("a")  # a's socket closed: its unpin rides on the next request, the pin holds till then
    t2, wait = gate.request("b", prompt(2, 700), 0, engine_in_use=600)
    assert wait is None and gate.snapshot()["engine_excess_tokens"] == 0
    assert gate.take_unpins() == ("a",)  # ... and this request carries it to the engine
