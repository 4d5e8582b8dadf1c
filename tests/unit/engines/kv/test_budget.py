"""The engine replica's KV budget as pure logic (cluster/engines/kv/budget.py), on a fake clock."""

from collections import OrderedDict

import pytest

from cluster.engines.kv.budget import BudgetPolicy, KvBudget, QueueFull


def budget(capacity=1000, **policy) -> KvBudget:
    return KvBudget(capacity, BudgetPolicy(**policy))


def req(b: KvBudget, session: str, need: int, now: float) -> tuple[int, bool]:
    ticket, admitted = b.request(session, need, now)
    return ticket, ticket in admitted


def test_a_turn_waits_until_running_and_retained_tokens_leave_room():
    b = budget(1000)
    t1, ok1 = req(b, "a", 600, now=0)
    t2, ok2 = req(b, "b", 600, now=0)
    assert ok1 and not ok2
    assert b.snapshot(0)["queued_tokens"] == 600
    # a finishes and is expected back: its 550 tokens stay, b still does not fit
    assert b.finish(t1, held=550, expect_back=True, now=1) == []
    # a's retention expires (initial TTL 10 s): b starts
    assert b.tick(now=5) == []
    assert b.tick(now=11) == [t2]
    assert b.counters.expired == 1
    assert b.counters.max_queue_wait_s == 11


def test_a_retained_session_comes_back_ahead_of_the_queue_and_keeps_its_prefix():
    b = budget(1000)
    t1, _ = req(b, "a", 500, now=0)
    b.finish(t1, held=500, expect_back=True, now=1)
    t2, ok2 = req(b, "b", 600, now=2)  # 500 retained + 600 > 1000
    assert not ok2
    # a's next turn needs 600 (its 500-token prefix + 100 new): only its growth counts
    t3, ok3 = req(b, "a", 600, now=3)
    assert ok3 and t2 in b.queue
    assert b.counters.returned_in_time == 1 and b.counters.reprefills == 0
    assert b.used == 600


def test_not_expected_back_and_released_sessions_free_their_tokens_at_once():
    b = budget(1000)
    t1, _ = req(b, "a", 500, now=0)
    b.finish(t1, held=500, expect_back=False, now=1)
    assert b.used == 0
    t2, _ = req(b, "b", 500, now=2)
    b.finish(t2, held=500, expect_back=True, now=3)
    assert b.retained_tokens == 500
    waiting, ok = req(b, "c", 700, now=4)
    assert not ok
    assert b.release("b", now=5) == [waiting]  # b's socket closed: c runs at once
    assert b.counters.released == 1
    # b comes back after all (store: true over HTTP): its turn is counted as a re-prefill
    req(b, "b", 100, now=6)
    assert b.counters.reprefills == 1


def test_the_ttl_is_learned_from_the_sessions_own_pauses_and_clamped():
    b = budget(10_000, ttl_initial_s=10, ttl_min_s=1, ttl_max_s=30, ttl_pause_multiple=2)
    t, _ = req(b, "a", 100, now=0)
    b.finish(t, held=100, expect_back=True, now=1)
    assert b.retained_sessions() == {"a": 11}  # no pause seen yet: the initial TTL
    t, _ = req(b, "a", 200, now=3)  # paused 2 s
    b.finish(t, held=200, expect_back=True, now=4)
    assert b.retained_sessions() == {"a": 4 + 2 * 2}
    t, _ = req(b, "a", 300, now=4.1)  # a short pause does not shrink the TTL below the long ones
    b.finish(t, held=300, expect_back=True, now=5)
    assert b.retained_sessions()["a"] == 5 + 2 * (0.8 * 2)
    t, _ = req(b, "a", 400, now=105)  # a 100 s pause: capped
    b.finish(t, held=400, expect_back=True, now=106)
    assert b.retained_sessions()["a"] == 106 + 30
    b2 = budget(10_000, ttl_min_s=1, ttl_pause_multiple=2)
    t, _ = req(b2, "x", 10, now=0)
    b2.finish(t, held=10, expect_back=True, now=0)
    t, _ = req(b2, "x", 10, now=0.01)
    b2.finish(t, held=10, expect_back=True, now=0.01)
    assert b2.retained_sessions()["x"] == 0.01 + 1  # floor


def test_a_session_with_uneven_pauses_is_still_retained_through_its_longer_ones():
    b = budget(10_000, ttl_min_s=1, ttl_pause_multiple=2)
    now = 0.0
    for pause in (0.5, 3.0, 0.6, 0.5, 2.9, 0.7, 3.0, 0.5):
        t, _ = req(b, "a", 100, now=now)
        now += 0.2
        b.finish(t, held=100, expect_back=True, now=now)
        now += pause
    # Only the first long pause, before any was seen, outlives the TTL (2x a moving average
    # would have missed every long pause after a short one)
    assert b.counters.expired == 1 and b.counters.returned_in_time == 6 and b.counters.reprefills == 1


def test_on_a_slow_engine_a_prefix_is_kept_at_least_as_long_as_computing_it_again_takes():
    # 2,000 tokens at 200 tokens/s (a CPU): 10 s to prefill again, where its 1 s pauses alone
    # would give 2 s. A pause of 4 s keeps the prefix. With a tier below at 10,000/s: 0.2 s, so
    # the learned 2 s holds. Capped by ttl_max_s (the 10,000 tokens: 30, not 50 s).
    def replica(**policy) -> KvBudget:
        b = budget(20_000, ttl_initial_s=5, ttl_min_s=1, ttl_max_s=30, ttl_pause_multiple=2, **policy)
        b.observe_prefill(2_000, 10.0)
        for start, held in ((0, 1_000), (2, 2_000)):  # back after a 1 s pause
            t, _ = req(b, "a", held, now=start)
            b.finish(t, held=held, expect_back=True, now=start + 1)
        t, _ = req(b, "big", 10_000, now=3)
        b.finish(t, held=10_000, expect_back=True, now=4)
        return b

    assert replica().retained_sessions() == {"a": 3 + 10, "big": 4 + 30}
    assert replica(lower_tier_tokens_per_s=10_000).retained_sessions() == {"a": 3 + 2, "big": 4 + 5}


def test_the_queue_is_fifo_for_new_sessions_and_a_small_turn_does_not_pass_a_blocked_head():
    b = budget(1000)
    t1, _ = req(b, "a", 900, now=0)
    big, _ = req(b, "b", 500, now=1)
    small, ok = req(b, "c", 50, now=2)  # fits, but b is first
    assert not ok
    assert b.finish(t1, held=900, expect_back=False, now=3) == [big, small]


def test_a_head_that_waited_too_long_ends_idle_retention_so_nobody_starves():
    b = budget(1000, ttl_initial_s=1000, max_queue_wait_s=5)
    held = []
    for i, key in enumerate("abc"):
        t, _ = req(b, key, 300, now=i)
        held.append(t)
    for i, t in enumerate(held):
        b.finish(t, held=300, expect_back=True, now=3 + i)  # a at 3, b at 4, c at 5
    head, ok = req(b, "d", 400, now=6)
    assert not ok
    assert b.next_deadline() == 11  # the wait bound, long before the TTLs
    assert b.tick(now=8) == []
    assert b.tick(now=11) == [head]
    assert b.counters.evicted == 1  # only the least recently used one (a) had to go
    assert set(b.retained_sessions()) == {"b", "c"}
    # a comes back: its prefix may be gone, and that is counted
    req(b, "a", 400, now=12)
    assert b.counters.reprefills == 1


def test_a_turn_larger_than_the_capacity_runs_when_the_replica_is_empty():
    b = budget(1000)
    t, ok = req(b, "a", 5000, now=0)
    assert ok
    t2, ok2 = req(b, "b", 10, now=0)
    assert not ok2
    assert b.finish(t, held=1000, expect_back=False, now=1) == [t2]


def test_a_cancelled_waiter_lets_the_next_one_in():
    b = budget(1000)
    t1, _ = req(b, "a", 800, now=0)
    w1, _ = req(b, "b", 800, now=0)
    w2, _ = req(b, "c", 100, now=0)
    assert b.cancel(w1, now=1) == [w2]
    assert b.finish(t1, held=0, expect_back=False, now=2) == []
    assert not b.queue


def test_retention_off_keeps_nothing():
    b = budget(1000, retention=False)
    t, _ = req(b, "a", 500, now=0)
    b.finish(t, held=500, expect_back=True, now=1)
    assert b.used == 0 and b.retained_sessions() == {}


def test_pause_statistics_of_old_idle_sessions_are_bounded():
    b = budget(10**9, max_sessions=10)
    for i in range(100):
        t, _ = req(b, f"s{i}", 1, now=i)
        b.finish(t, held=1, expect_back=False, now=i)
    assert len(b.sessions) <= 11


def test_every_ended_retention_is_reported_once_for_the_engine_to_unpin():
    b = budget(1000, ttl_initial_s=5, max_queue_wait_s=100)
    ta, _ = req(b, "a", 100, now=0)
    tb, _ = req(b, "b", 100, now=0)
    tc, _ = req(b, "c", 100, now=0)
    b.finish(ta, held=100, expect_back=True, now=1)  # retained, expires at 6
    b.finish(tb, held=100, expect_back=False, now=1)  # not retained: unpin at once
    b.finish(tc, held=100, expect_back=True, now=2)
    assert b.take_dropped() == ["b"]
    b.release("c", now=3)
    b.tick(now=7)
    assert sorted(b.take_dropped()) == ["a", "c"]
    assert b.take_dropped() == []


def test_a_request_that_lets_earlier_waiters_in_returns_their_tickets_too():
    b = budget(1000, ttl_initial_s=5, max_queue_wait_s=100)
    t1, _ = req(b, "a", 600, now=0)
    b.finish(t1, held=600, expect_back=True, now=1)  # retained until 6
    waiting, ok = req(b, "b", 600, now=2)
    assert not ok
    # a's retention has expired by the time c arrives: c's own request lets b in first
    late, admitted = b.request("c", 300, now=7)
    assert admitted == [waiting, late]


def test_behind_a_head_that_waited_too_long_nobody_passes_and_queued_residents_give_way_last():
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=10)
    ta, _ = req(b, "a", 400, now=0)
    tb, _ = req(b, "b", 400, now=0)
    b.finish(ta, held=400, expect_back=True, now=1)
    head, ok = req(b, "c", 700, now=2)  # 400 running + 400 retained + 700 > 1000
    assert not ok
    ta2, ok = req(b, "a", 450, now=3)  # a is resident: it passes while the head is not overdue
    assert ok
    b.finish(ta2, held=450, expect_back=True, now=4)
    # The head is overdue: a's retention goes (it is queued behind the head), and although a's
    # turn would fit beside b, it does not pass the head
    back, admitted = b.request("a", 460, now=13)
    assert admitted == [] and b.counters.evicted == 1
    assert b.finish(tb, held=400, expect_back=False, now=14) == [head]
    assert b.finish(head, held=700, expect_back=False, now=15) == [back]


def test_a_session_whose_turn_waits_keeps_its_retention_past_its_ttl():
    b = budget(1000, ttl_initial_s=5, max_queue_wait_s=1000)
    ta, _ = req(b, "a", 300, now=0)
    tb, _ = req(b, "b", 600, now=0)
    b.finish(ta, held=300, expect_back=True, now=1)  # retained until 6
    back, ok = req(b, "a", 500, now=2)  # its growth (200) does not fit beside b's 600
    assert not ok
    assert b.tick(now=10) == [] and b.counters.expired == 0  # still retained: it is back
    assert b.finish(tb, held=600, expect_back=False, now=11) == [back]
    assert b.counters.reprefills == 0


def test_when_nothing_runs_a_session_that_cannot_grow_ends_idle_retention_at_once():
    # Every token is held by sessions between turns: waiting would idle the engine until a TTL
    # (or, with every session back and waiting, until the queue's wait bound)
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=1000)
    tickets = {s: req(b, s, 300, now=0)[0] for s in "abc"}
    tb = req(b, "d", 100, now=0)[0]
    for i, s in enumerate("abc"):
        b.finish(tickets[s], held=300, expect_back=True, now=1 + i)  # c is the most recently used
    ta, ok_a = req(b, "a", 600, now=5)  # growth 300: 900 retained + 100 running + 300 > 1000
    tb2, ok_b = req(b, "b", 600, now=5)
    assert not ok_a and not ok_b
    # d's turn ends and it leaves: nothing runs, a is first in line, c is idle and goes first
    assert b.finish(tb, held=100, expect_back=False, now=6) == [ta]
    assert b.sessions["c"].retained == 0 and b.sessions["b"].retained == 300
    assert b.counters.evicted == 1 and b.take_dropped() == ["d", "c"]
    assert b.counters.max_queue_wait_s == 1


def test_among_sessions_waiting_to_grow_the_newest_waiter_gives_way():
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=1000)
    tickets = {s: req(b, s, 300, now=0)[0] for s in "abc"}
    td = req(b, "d", 100, now=0)[0]
    for s in "abc":
        b.finish(tickets[s], held=300, expect_back=True, now=1)
    waiting = [req(b, s, 600, now=2 + i)[0] for i, s in enumerate("abc")]
    admitted = b.finish(td, held=100, expect_back=False, now=9)
    # c (queued last) gives way for a; b's growth does not fit beside a's running turn yet
    assert admitted == [waiting[0]]
    assert b.sessions["c"].retained == 0 and b.sessions["b"].retained == 300
    assert waiting[1] in b.queue and waiting[2] in b.queue


def test_a_new_session_still_waits_for_an_idle_sessions_retention():
    b = budget(1000, ttl_initial_s=5, max_queue_wait_s=1000)
    ta, _ = req(b, "a", 600, now=0)
    b.finish(ta, held=600, expect_back=True, now=1)
    tb, ok = req(b, "b", 600, now=2)  # nothing runs, but a is in its tool pause: b waits
    assert not ok and b.counters.evicted == 0
    assert b.tick(now=6.5) == [tb] and b.counters.expired == 1


def test_a_new_session_leaves_the_sessions_here_room_for_their_next_turn():
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=1000)
    ta, _ = req(b, "a", 300, now=0)
    tb, _ = req(b, "b", 200, now=0)
    b.finish(ta, held=300, expect_back=True, now=1)
    b.finish(tb, held=200, expect_back=True, now=1)
    ta, ok = req(b, "a", 400, now=2)  # a grows by 100 a turn
    assert ok and b.growth_per_turn == 100
    b.finish(ta, held=400, expect_back=True, now=3)
    # 600 held; c's 350 would fit, but not beside a's and b's next 100 each
    tc, ok = req(b, "c", 350, now=4)
    assert not ok and b.snapshot(4)["growth_room_tokens"] == 200
    tb, ok = req(b, "b", 300, now=5)  # b passes (resident) and grows
    assert ok
    assert b.finish(tb, held=300, expect_back=False, now=6) == [tc]  # b leaves: 400 + 350 + 100 spare fit


def test_the_running_totals_match_the_holds_after_any_sequence_of_calls():
    """`used`, `running_tokens` and `growth_room` are O(1) totals: they must equal a walk over
    the holds whatever happens (random turns, finishes, cancels, releases, ticks, evictions)."""
    import random

    rng = random.Random(7)
    budget = KvBudget(capacity=5000, policy=BudgetPolicy(max_queue_wait_s=3.0, ttl_initial_s=2.0, max_queued_turns=8,
                                                         max_queued_per_tenant=4, tenant_share=0.6))
    budget.observe_prefill(3000, 1.0)
    live: list[int] = []
    now = 0.0
    for _ in range(3000):
        now += rng.random()
        op = rng.random()
        if op < 0.4:
            session = rng.randrange(40)
            try:
                ticket, admitted = budget.request(f"s{session}", rng.randrange(50, 1500), now,
                                                  tenant=f"t{session % 3}", min_ttl_s=rng.choice([0, 0, 5]),
                                                  shared=rng.choice([0, 48, 300]), share_group=f"t{session % 3}")
            except QueueFull:
                continue
            live.append(ticket)
        elif op < 0.7 and live:
            budget.finish(live.pop(rng.randrange(len(live))), rng.randrange(0, 1600), rng.random() < 0.5, now,
                          continuable=rng.random() < 0.7)
        elif op < 0.8 and live:
            budget.cancel(live.pop(rng.randrange(len(live))), now)
        elif op < 0.9:
            budget.release(f"s{rng.randrange(40)}", now)
        else:
            budget.tick(now)
        holds = budget.sessions.values()
        heads: dict[str, int] = {}  # each head once, at its longest among the resident sessions
        for h in holds:
            if (h.retained or h.turns) and h.shared:
                heads[h.share_group] = max(heads.get(h.share_group, 0), h.shared)
        assert budget.used == sum(h.footprint for h in holds) + sum(heads.values())
        assert budget.running_tokens == sum(h.running for h in holds)
        resident = sum(1 for h in holds if h.retained or h.turns)
        assert budget.growth_room() == max(int(budget.growth_per_turn * resident),
                                           budget.shape.to_end(resident, sum(h.footprint for h in holds),
                                                               budget.prefill_tps))
        for tenant in ("t0", "t1", "t2"):
            assert budget._tenant_retained[tenant] == sum(h.own_retained for h in holds if h.tenant == tenant)
            assert budget._tenant_queued[tenant] == sum(1 for w in budget.queue.values() if w.tenant == tenant)
        # past the limit, only turns of sessions back to a retained prefix (never refused: they
        # hold their room already)
        over = sum(1 for w in budget.queue.values() if budget.sessions[w.session].retained)
        assert len(budget.queue) <= 8 + over


# -- a session is a chain: HTTP, reconnects, declared lifetimes ---------------------------


def test_a_continuable_chain_is_kept_softly_until_a_waiting_turn_needs_its_room():
    b = budget(1000, ttl_initial_s=100, max_queue_wait_s=1000)
    t, _ = req(b, "http-chain", 600, now=0)
    b.finish(t, held=600, expect_back=False, now=1, continuable=True)  # stored over HTTP: it may come back
    assert b.retained_sessions() == {"http-chain": 101}
    waiting, ok = req(b, "other", 600, now=2)
    # a soft retention gives its room at once: no wait for a chain that gave no sign
    assert ok and b.counters.evicted_soft == 1 and b.retained_sessions() == {}


def test_a_chain_that_came_back_is_expected_back_whatever_carries_it():
    b = budget(1000, ttl_initial_s=100, max_queue_wait_s=1000)
    t, _ = req(b, "chain", 300, now=0)
    b.finish(t, held=300, expect_back=False, now=1, continuable=True)
    t, ok = req(b, "chain", 500, now=2)  # it came back (a new socket, or the next HTTP request)
    assert ok and b.counters.returned_in_time == 1
    b.finish(t, held=500, expect_back=False, now=3, continuable=True)
    waiting, ok = req(b, "new", 600, now=4)
    assert not ok and b.retained_sessions() == {"chain": 3 + 2 * 1}  # firm now, its TTL learned from its pause
    assert b.tick(now=5.5) == [waiting] and b.counters.expired == 1 and b.counters.evicted_soft == 0


def test_not_continuable_and_never_back_is_not_retained_even_after_returns():
    b = budget(1000)
    t, _ = req(b, "a", 300, now=0)
    b.finish(t, held=300, expect_back=True, now=1)
    t, _ = req(b, "a", 400, now=2)
    b.finish(t, held=400, expect_back=False, now=3)  # store: false over HTTP: it cannot be continued
    assert b.retained_sessions() == {}


def test_a_declared_lifetime_keeps_the_prefix_past_the_learned_ttl_and_is_clamped():
    b = budget(10_000, ttl_initial_s=10, ttl_max_s=60, ttl_client_max_s=3600)
    t = b.request("a", 100, 0, min_ttl_s=1800)[0]
    b.finish(t, held=100, expect_back=False, now=1, continuable=True)
    assert b.retained_sessions() == {"a": 1 + 1800}
    assert not b.sessions["a"].soft  # a declared lifetime is a sign it comes back
    t = b.request("b", 100, 2, min_ttl_s=12 * 3600)[0]
    b.finish(t, held=100, expect_back=False, now=3, continuable=True)
    assert b.retained_sessions()["b"] == 3 + 3600


def test_a_new_session_waits_for_room_while_something_runs_and_on_an_idle_engine_for_the_reprefill_it_costs():
    # Nothing runs: each second waited idles the engine. At 10,000 tokens/s, freeing 400 tokens
    # means ending a's retention, and a back later prefills all its 600 again: 0.06 s
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60)
    b.observe_prefill(10_000, 1.0)
    t, _ = req(b, "a", 600, now=0)
    b.finish(t, held=600, expect_back=True, now=1)
    head, ok = req(b, "b", 700, now=2)  # 700 + 600 > 1000
    assert not ok and b.next_deadline() == pytest.approx(2.06)
    assert b.tick(now=2.05) == [] and b.tick(now=2.07) == [head] and b.counters.evicted == 1
    # Something runs: ending a's retention would only trade places (a is back within its pause
    # and waits in turn), so b waits for room up to max_queue_wait_s: whole sessions in waves
    c = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60)
    c.observe_prefill(10_000, 1.0)
    t, _ = req(c, "a", 600, now=0)
    c.finish(t, held=600, expect_back=True, now=1)
    running, _ = req(c, "r", 100, now=1)
    head, ok = req(c, "b", 700, now=2)
    assert not ok and c.next_deadline() == 62 and c.tick(now=10) == []
    # ... until the engine has nothing to run: overdue already (0.06 s), a goes
    assert c.finish(running, held=100, expect_back=False, now=11) == [head]
    assert c.counters.evicted == 1 and c.retained_sessions() == {}


def test_short_prefills_do_not_set_the_rate():
    b = budget(1000)
    b.observe_prefill(10, 0.05)  # the engine's fixed cost, not its rate
    assert b.prefill_tps is None
    b.observe_prefill(1000, 0.5)
    b.observe_prefill(1000, 1.0)
    assert b.prefill_tps == pytest.approx(2000 + 0.2 * (1000 - 2000))


def test_the_queue_is_bounded_and_a_refusal_says_when_to_retry():
    b = budget(1000, max_queued_turns=2, max_queued_per_tenant=1, max_queue_wait_s=30)
    t, _ = req(b, "a", 900, now=0)
    b.request("w1", 500, 1, tenant="x")
    with pytest.raises(QueueFull) as refused:
        b.request("w2", 500, 2, tenant="x")  # x's one waiting turn is its share of the queue
    assert refused.value.tenant_limit and 1 <= refused.value.retry_after_s <= 30
    b.request("w3", 500, 3, tenant="y")
    with pytest.raises(QueueFull) as refused:
        b.request("w4", 500, 4, tenant="z")
    assert not refused.value.tenant_limit and b.counters.refused == 2 and len(b.queue) == 2
    # a turn that starts at once is never refused, nor one whose session is retained here
    b.finish(t, held=100, expect_back=True, now=5)
    assert b.request("a", 200, 6, tenant="z")[1]


def test_one_tenant_retains_at_most_its_share():
    b = budget(1000, tenant_share=0.5, ttl_initial_s=100)
    for i, s in enumerate("abc"):
        t = b.request(s, 200, i, tenant="big")[0]
        b.finish(t, held=200, expect_back=True, now=i + 0.5)
    t = b.request("d", 200, 4, tenant="small")[0]
    b.finish(t, held=200, expect_back=True, now=4.5)
    # big holds 400 of 1000 after its oldest retention (a) went; small is untouched
    assert set(b.retained_sessions()) == {"b", "c", "d"} and b.counters.over_share == 1


def test_a_tenant_s_shared_head_counts_once_toward_its_share():
    """Ten sessions of one tenant each hold a 700-token head they share and 500 tokens of their
    own: the pool holds 5,700 of 10,000. Counted with the head in each (12,000), the tenant read
    over the whole pool and the cap ended their retentions, least recently used first: in a loop,
    the sessions due back next (h100-8b grid: a third of all retention ends)."""
    b = budget(10_000, ttl_initial_s=100)
    for i in range(10):
        t = b.request(f"s{i}", 1_200, i, tenant="T", shared=700, share_group="T-head")[0]
        b.finish(t, held=1_200, expect_back=True, now=i + 0.5)
    assert b.used == 700 + 10 * 500
    assert len(b.retained_sessions()) == 10 and b.counters.over_share == 0
    # at half the pool, 5,000 of its own fit; one session more (5,500) is over: the oldest goes
    half = budget(10_000, ttl_initial_s=100, tenant_share=0.5)
    for i in range(11):
        t = half.request(f"s{i}", 1_200, i, tenant="T", shared=700, share_group="T-head")[0]
        half.finish(t, held=1_200, expect_back=True, now=i + 0.5)
    assert "s0" not in half.retained_sessions() and len(half.retained_sessions()) == 10
    assert half.counters.over_share == 1


class CountingSessions(OrderedDict):
    """The budget's session table, counting full walks over it."""

    walks = 0
    visited = 0

    def items(self):
        type(self).walks += 1
        for entry in super().items():
            type(self).visited += 1
            yield entry

    def values(self):
        type(self).walks += 1
        return super().values()


def test_a_turn_does_not_walk_every_tracked_session():
    """Up to max_sessions (100,000) are tracked for their pauses, most of them long
    idle; a turn's decisions look at the sessions that hold KV, not at all of them."""
    budget = KvBudget(10_000, BudgetPolicy(retention=True))
    budget.sessions = CountingSessions()
    now = 0.0
    for i in range(5_000):  # stateless HTTP turns: each a new session, none retained
        t, _ = budget.request(f"gone{i}", 10, now)
        budget.finish(t, 10, expect_back=False, now=now)
        now += 0.01
    for i in range(4):
        t, _ = budget.request(f"agent{i}", 500, now)
        budget.finish(t, 500, expect_back=True, now=now)
    CountingSessions.walks = 0
    for step in range(200):
        now += 0.5
        t, _ = budget.request(f"agent{step % 4}", 520, now)
        budget.next_deadline()
        budget.finish(t, 520, expect_back=True, now=now)
        budget.tick(now)
        assert budget.retained_tokens == sum(h.retained for h in dict(budget.sessions).values() if not h.turns)
    assert CountingSessions.walks == 0
    assert budget.snapshot(now)["retained_sessions"] == 4


def test_retentions_expire_in_time_order_and_a_waiting_session_keeps_its_place():
    budget = KvBudget(1_000, BudgetPolicy(retention=True, ttl_initial_s=10.0, max_queue_wait_s=1e9))
    a, _ = budget.request("a", 400, 0.0)
    budget.finish(a, 400, expect_back=True, now=0.0)  # expires at 10
    b, _ = budget.request("b", 400, 5.0)
    budget.finish(b, 400, expect_back=True, now=5.0)  # expires at 15
    c, started = budget.request("c", 900, 6.0)  # does not fit: waits
    assert started == [] and budget.next_deadline() == 10.0
    budget.tick(10.0)
    assert "a" in budget.take_dropped() and budget.sessions["b"].retained == 400
    back, _ = budget.request("b", 450, 12.0)  # b's turn waits behind c: b is back, it keeps its place
    budget.tick(20.0)
    assert budget.sessions["b"].retained == 400 and "b" not in budget.take_dropped()


def test_forgetting_idle_sessions_stops_as_soon_as_enough_are_gone():
    budget = KvBudget(10_000, BudgetPolicy(retention=True, max_sessions=1_000))
    budget.sessions = CountingSessions()
    CountingSessions.visited = 0
    for i in range(3_000):
        t, _ = budget.request(f"s{i}", 10, float(i))
        budget.finish(t, 10, expect_back=False, now=float(i))
    assert len(budget.sessions) == 1_000 and "s2999" in budget.sessions and "s0" not in budget.sessions
    assert CountingSessions.visited <= 2 * 2_000  # about one entry a forgotten session, not the table each time


def test_one_tenant_s_retention_gives_way_to_another_tenant_s_new_session_at_once():
    """Tenant A's retained prefixes fill the replica; tenant B's first turn does not
    wait for their TTLs or the queue's wait bound: A is over its fair share, B under."""
    budget = KvBudget(10_000, BudgetPolicy(retention=True, ttl_initial_s=600.0, max_queue_wait_s=60.0))
    for i in range(10):
        t, _ = budget.request(f"a{i}", 950, float(i), tenant="A")
        budget.finish(t, 950, expect_back=True, now=float(i))
    running, _ = budget.request("a-busy", 400, 10.0, tenant="A")  # something runs: waiting would cost nothing
    assert budget.demand() == pytest.approx((9_500 + 400) / 10_000)  # one tenant: all of it counts
    ticket, started = budget.request("b0", 2_000, 11.0, tenant="B")
    assert started == [ticket]
    assert budget.counters.over_share >= 2 and budget._tenant_retained["A"] <= 10_000 - 2_000 - 400
    # A tenant at or under its share is not evicted for another: a second B session is not let
    # in over A's remaining retention before B's fair share is reached.
    budget.finish(ticket, 2_000, expect_back=True, now=12.0)
    assert budget.sessions["b0"].retained == 2_000


def test_a_key_declaring_long_lifetimes_pins_at_most_its_declared_share_for_at_most_30_minutes():
    """Ten `12h` prewarms of one key held a replica's whole KV for 12 hours and its
    autoscaling demand at 1.0. A declared lifetime is clamped to `ttl_client_max_s` (30 min by
    default); one tenant's idle declared retention is capped at `declared_share` of the capacity
    (past it, a session is retained as any other: by its pauses); and idle declared retention is
    no autoscaling demand."""
    b = budget(100_000)  # the shipped defaults
    for i in range(10):
        ticket, admitted = b.request(f"pin{i}", 10_000, 0.0, tenant="T", min_ttl_s=12 * 3600)
        assert ticket in admitted
        b.finish(ticket, 10_000, expect_back=False, now=0.0, continuable=True)
    declared = {k: v for k, v in b.retained_sessions().items() if v > 60}
    assert declared == {"pin0": 1800.0, "pin1": 1800.0}  # 20,000 of a 25,000 share; clamped to 30 min
    assert b.counters.declared_over_share == 8
    assert b.demand() == pytest.approx(0.8)  # the 8 kept for their learned 10 s count; the declared do not ...
    b.tick(120.0)
    assert b.retained_tokens == 20_000 and b.demand() == pytest.approx(0.0)
    other, admitted = b.request("newcomer", 70_000, 120.0, tenant="U")
    assert other in admitted  # ... and the rest of the replica serves others at once
    assert b.demand() == pytest.approx(0.7)
    b.tick(1801.0)
    assert set(b.retained_sessions()) == set()  # the declared ones end at 30 min


def test_a_session_back_under_its_declared_lifetime_is_counted_as_running_then_idle_again():
    b = budget(100_000)
    t = b.request("a", 10_000, 0.0, tenant="T", min_ttl_s=1800)[0]
    b.finish(t, 10_000, expect_back=False, now=0.0, continuable=True)
    assert b._declared_idle_tokens == 10_000 and b._tenant_declared["T"] == 10_000
    t = b.request("a", 12_000, 5.0, tenant="T", min_ttl_s=1800)[0]
    assert b._declared_idle_tokens == 0 and b.demand() == pytest.approx(0.12)  # running: demand again
    b.finish(t, 12_000, expect_back=False, now=6.0, continuable=True)
    assert b._declared_idle_tokens == 12_000 and b._tenant_declared["T"] == 12_000
    b.release("a", 7.0)
    assert b._declared_idle_tokens == 0 and not b._tenant_declared


def test_idle_declared_sessions_sharing_a_head_do_not_hide_another_tenant_s_running_turn_from_demand():
    """Ten declared sessions sharing a 4,000-token head hold 4,000 + 10 x 6,000 of the pool.
    Counted with the head in each (100,000), their idle declared retention outweighed all the
    pool held, and another tenant's running 30,000-token turn read as no demand at all."""
    b = budget(100_000, declared_share=1.0)
    for i in range(10):
        t = b.request(f"pin{i}", 10_000, 0.0, tenant="T", min_ttl_s=600, shared=4_000, share_group="T-head")[0]
        b.finish(t, 10_000, expect_back=False, now=0.0, continuable=True)
    assert b.used == 64_000 and b._declared_idle_tokens == 60_000
    t, admitted = b.request("other", 30_000, 1.0, tenant="U")
    assert t in admitted
    assert b.demand() == pytest.approx((4_000 + 30_000) / 100_000)  # the running turn, and the head still held
