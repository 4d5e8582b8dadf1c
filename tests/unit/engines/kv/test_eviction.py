"""When the KV budget ends retention early (cluster/engines/kv/eviction.py, with the rules of
kv/budget.py): beside a tier below the engine; pure logic on a fake clock."""

import pytest

from cluster.engines.kv.budget import BudgetPolicy, KvBudget


def budget(capacity=1000, **policy) -> KvBudget:
    return KvBudget(capacity, BudgetPolicy(**policy))


def test_with_a_lower_tier_an_ended_retention_costs_only_its_copy_back_so_a_turn_waits_that_long():
    # A busy engine would let a new session wait max_queue_wait_s (60 s) for room; with a tier
    # below, ending a retention costs a copy back of its 600 tokens at 100,000/s, not a re-prefill.
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60,
               lower_tier_tokens_per_s=100_000)
    b.observe_prefill(1_000, 1.0)
    t, _ = b.request("a", 600, 0)
    b.finish(t, held=600, expect_back=True, now=1)
    b.request("r", 100, 1)
    head, admitted = b.request("b", 700, 2)
    assert head not in admitted and b.next_deadline() == pytest.approx(2.006)
    assert b.tick(now=2.005) == [] and b.tick(now=2.01) == [head] and b.counters.evicted == 1


def idle(b: KvBudget, sizes: dict[str, int], now: float = 0.0) -> None:
    """Sessions that ran one turn each and are now in a tool pause, retained."""
    for key, size in sizes.items():
        t, _ = b.request(key, size, now)
        b.finish(t, held=size, expect_back=True, now=now + 1)


@pytest.mark.parametrize("order", ["abcd", "dcba", "cadb"])
def test_the_cheapest_retention_ends_whatever_order_the_sessions_arrived_in(order):
    # a head short of 350 tokens: two of 300 (cost 600) lose to the one 400 that covers it
    # alone (cost 400); the 900 is never touched. The same choice for every arrival order.
    b = budget(2000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=5)
    sizes = {"a": 300, "b": 300, "c": 400, "d": 900}
    idle(b, {k: sizes[k] for k in order})
    head, admitted = b.request("new", 450, 2)  # 1900 held + 450 > 2000
    assert head not in admitted
    assert b.tick(now=7) == [head]
    assert set(b.retained_sessions()) == {"a", "b", "d"}
    assert [(e.why, e.tokens) for e in b.ends] == [("cost", 400)]


def test_small_retentions_end_before_one_large_when_together_they_cost_less():
    b = budget(2000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=5)
    idle(b, {"big": 1000, "a": 200, "b": 200, "c": 300})
    head, _ = b.request("new", 650, 2)  # short of 350: a + b (400) rather than big (1000)
    assert b.tick(now=7) == [head]
    assert set(b.retained_sessions()) == {"big", "c"}


def test_the_wait_bound_is_the_victims_expected_reprefill_shared_by_every_waiting_turn():
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60)
    b.observe_prefill(1000, 1.0)  # 1,000 tokens/s, GPU-like (no shared compute unit)
    idle(b, {"a": 600})
    head, _ = b.request("b", 500, 2)
    assert b.next_deadline() == pytest.approx(2.6)  # a's 600 tokens, sure to be back (no record yet)
    b.request("c", 100, 2)
    b.request("d", 100, 2)
    # three turns wait now: each second waited costs three
    assert b.next_deadline() == pytest.approx(2.2)


def test_retentions_that_expired_unused_make_the_next_ones_cheaper_to_end():
    b = budget(1000, ttl_initial_s=1, ttl_min_s=1, ttl_max_s=1, max_queue_wait_s=60)
    b.observe_prefill(1000, 1.0)
    idle(b, {"x": 100, "y": 100, "z": 100})
    b.tick(now=5)  # all three expired: none came back
    assert b.counters.expired == 3
    # the replica's record (1 / 4) weighs one chain against the three that ended after 1 turn
    assert b.return_chance(b.sessions["x"]) == pytest.approx(0.25 / 4)
    chain(b, "a", [0.5], start=8, size=500)  # 2 turns (no record at that length), 600 tokens to 11.5
    head, _ = b.request("b", 500, 11.0)
    # the replica's record, now that a came back once in time: (1 + 1) / (1 + 3 + 1)
    assert b.next_deadline() == pytest.approx(11.0 + 0.4 * 0.6)
    b.sessions["a"].soft = True
    assert b.return_chance(b.sessions["a"]) == pytest.approx(0.2)


def test_on_a_busy_engine_a_new_session_waits_for_room_but_a_returning_one_does_not():
    # Something runs: a new session waits for room up to max_queue_wait_s (whole sessions in
    # waves). A session back for its next turn gets no room by waiting: the cost rule applies.
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60)
    b.observe_prefill(1000, 1.0)
    idle(b, {"a": 400, "b": 200})
    b.request("r", 300, 2)  # runs
    new, _ = b.request("n", 300, 3)
    assert b.next_deadline() == 63
    b.cancel(new, 3)
    back, admitted = b.request("b", 400, 4)  # b grows by 200: 100 short, a (400) would go
    assert back not in admitted and b.next_deadline() == pytest.approx(4.4)
    assert b.tick(now=4.5) == [back] and set(b.retained_sessions()) == set()


def test_a_session_back_to_its_prefix_behind_a_waiting_new_session_ends_retention_at_its_own_deadline():
    b = budget(1000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60)
    b.observe_prefill(1000, 1.0)
    idle(b, {"a": 300, "b": 200, "c": 300})
    b.request("r", 150, 2)  # runs
    new, _ = b.request("n", 300, 3)  # waits for room (60 s: waves)
    back, admitted = b.request("a", 400, 4)  # grows by 100: no room beside the head's wait
    assert back not in admitted
    # b (200, the cheapest) is worth 0.2 s of re-prefill, shared by the 2 waiting turns: 0.1 s
    assert b.next_deadline() == pytest.approx(4.1)
    assert b.tick(now=4.11) == [back]
    assert set(b.retained_sessions()) == {"c"} and new in b.queue


def test_a_chain_idle_far_past_its_longest_pause_ends_before_a_smaller_one_still_in_its_pause():
    # An HTTP chain that ended says nothing: "done" kept its 900 tokens through a pause of 1 s
    # and has been idle 11 s; "live" (300) pauses up to 10 s and is 2 s into this one. By size
    # alone "live" would go, but "done" is the one unlikely to come back.
    b = budget(2000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=5)
    for key, size, pause in (("done", 900, 1.0), ("live", 300, 10.0)):
        t, _ = b.request(key, size - 100, 0)
        b.finish(t, held=size - 100, expect_back=True, now=1)
        t, _ = b.request(key, size, 1 + pause)
        b.finish(t, held=size, expect_back=True, now=2 + pause)
    idle(b, {"other": 600}, now=12)
    head, admitted = b.request("new", 500, 14)  # 1800 held + 500 > 2000: 300 short
    assert head not in admitted
    assert b.return_chance(b.sessions["done"]) == pytest.approx(1 / 11)  # longest pause 1 s, idle 11 s
    assert b.return_chance(b.sessions["live"]) == pytest.approx(1.0)
    assert b.tick(now=19) == [head]
    assert set(b.retained_sessions()) == {"live", "other"}


def chain(b: KvBudget, key: str, pauses: list[float], start: float = 0.0, size: int = 300,
          min_ttl_s: float = 0.0) -> float:
    """A chain of turns of 1 s each, 100 tokens more each, with `pauses` between them, kept
    through its pauses (it called tools); returns when its last turn ended."""
    now = start
    for i, pause in enumerate([0.0] + pauses):
        now += pause
        ticket, _ = b.request(key, size + 100 * i, now, min_ttl_s=min_ttl_s)
        now += 1
        b.finish(ticket, held=size + 100 * i, expect_back=True, now=now)
    return now


def test_a_chain_idle_past_twice_every_pause_it_took_gives_its_room_at_once_but_a_long_pauser_does_not():
    # "done" paused 0.5 s each time and has been idle 4 s: it most likely ended (an HTTP chain
    # says nothing). "long" once paused 3 s, then 0.5 s three times: its decayed longest pause
    # is 1.5 s, but it is 4 s into a pause shorter than the one it took. A new session on a busy
    # replica takes "done"'s room at once and leaves "long" alone (no wait for a TTL that the
    # re-prefill floor keeps long on a slow engine).
    b = budget(2000, ttl_initial_s=1000, ttl_min_s=1, ttl_max_s=2000, max_queue_wait_s=60)
    b.observe_prefill(100, 1.0)  # a slow engine: 600 tokens take 6 s again
    end = chain(b, "done", [0.5, 0.5, 0.5], start=2.5)
    assert chain(b, "long", [3.0, 0.5, 0.5]) == end
    assert b.sessions["long"].pause_max == 3.0 and b.sessions["long"].pause_high < 2.0
    b.request("r", 300, end + 3)  # runs
    new, admitted = b.request("n", 700, end + 4)  # 600 + 600 + 300 + 700 > 2000
    assert new in admitted and b.counters.evicted_lapsed == 1 and b.counters.evicted_soft == 0
    assert set(b.retained_sessions()) == {"long"}
    # why it went, in `stats`: lapsed, its 600 tokens after 4 turns, idle 4 s, its chance then
    (gone,) = b.ends
    assert (gone.why, gone.tokens, gone.turns, gone.idle_s) == ("lapsed", 600, 4, 4.0) and gone.chance < 0.5


def test_a_chain_with_a_declared_lifetime_or_too_few_pauses_is_never_lapsed():
    b = budget(2000, ttl_initial_s=1000, ttl_min_s=1, ttl_max_s=2000)
    end = chain(b, "young", [0.5])  # one pause seen: not enough to tell its end from a pause
    chain(b, "declared", [0.5, 0.5], min_ttl_s=600)
    b._expire(end + 100)
    assert not b.lapsed(b.sessions["young"]) and not b.lapsed(b.sessions["declared"])


def replica_whose_chains_end_after(turns: int, ended_by: str) -> KvBudget:
    """Three chains of `turns` turns (pauses of 0.5 s) that ended: their sockets closed
    (`release`), or, as HTTP chains end, without a word (their retention expired unused)."""
    b = budget(2000, ttl_initial_s=10, ttl_min_s=10, ttl_max_s=10, max_queue_wait_s=60)
    for i in range(3):
        end = chain(b, f"old{i}", [0.5] * (turns - 1), size=100)
        if ended_by == "close":
            b.release(f"old{i}", end)
    b.tick(100)  # the others' retention expired
    assert b.lengths.likely_ended(turns) and b.counters.expired + b.counters.released == 3
    return b


@pytest.mark.parametrize("ended_by", ["close", "expiry"])
def test_a_chain_at_the_length_chains_here_end_after_gives_its_room_at_once_however_the_others_ended(ended_by):
    # An HTTP chain that ended says nothing, where a socket's close frees its room: learning how
    # many turns chains here run lets both free it. "done" (4 turns, 600 tokens) is 1 s into a
    # pause of the kind it took (not lapsed); "mid" (2 turns, 400) too. A new session on a busy
    # replica takes "done"'s room at once and leaves "mid", whose kind goes on, alone.
    b = replica_whose_chains_end_after(4, ended_by)
    end = chain(b, "done", [0.5, 0.5, 0.5], start=100)
    assert chain(b, "mid", [0.5], start=end - 2.5) == end
    assert not b.lapsed(b.sessions["done"]) and b.ended(b.sessions["done"]) and not b.ended(b.sessions["mid"])
    assert b.return_chance(b.sessions["done"]) <= 0.25 and b.return_chance(b.sessions["mid"]) > 0.9
    b.request("r", 300, end + 0.5)  # runs
    new, admitted = b.request("n", 900, end + 1)  # 600 + 400 + 300 + 900 > 2000
    assert new in admitted and b.counters.evicted_lapsed == 1
    assert set(b.retained_sessions()) == {"mid"}


def test_a_chain_with_a_declared_lifetime_is_kept_at_the_length_chains_end_after():
    b = replica_whose_chains_end_after(3, "close")
    end = chain(b, "declared", [0.5, 0.5], start=100, min_ttl_s=600)
    b._expire(end + 1)
    assert not b.ended(b.sessions["declared"])


def test_a_chain_on_an_open_socket_is_not_ended_by_its_length():
    # Chains here ended after 1 turn (their sockets closed), and "a" has had 1 turn on a socket
    # still open: its close will tell its end, so it is a session in its pause, kept by the cost
    # rule at the replica's record over all, not the 1-turn chains' record.
    b = budget(2000, ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60)
    for key in ("x", "y", "z"):
        t, _ = b.request(key, 100, 0)
        b.finish(t, held=100, expect_back=True, now=1, close_tells_end=True)
        b.release(key, 1)
    assert b.lengths.likely_ended(1)
    t, _ = b.request("a", 900, 2)
    b.finish(t, held=900, expect_back=True, now=3, close_tells_end=True)
    t, _ = b.request("http", 900, 2)
    b.finish(t, held=900, expect_back=True, now=3)
    assert not b.ended(b.sessions["a"]) and b.return_chance(b.sessions["a"]) == pytest.approx(1.0)
    assert b.ended(b.sessions["http"]) and b.return_chance(b.sessions["http"]) == pytest.approx(0.25)


def test_the_record_of_why_retentions_ended_keeps_only_the_latest():
    from cluster.engines.kv.budget import RECENT_ENDS

    b = budget(100_000)
    for i in range(RECENT_ENDS + 36):
        t, _ = b.request(f"s{i}", 10 + i, i)
        b.finish(t, held=10 + i, expect_back=True, now=i + 0.5)
        b.release(f"s{i}", i + 0.75)
    assert len(b.ends) == RECENT_ENDS  # bounded, however many sessions passed
    assert (b.ends[-1].why, b.ends[-1].tokens, b.ends[-1].idle_s) == ("released", 10 + RECENT_ENDS + 35, 0.25)
