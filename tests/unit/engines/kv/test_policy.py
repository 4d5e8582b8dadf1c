"""Waves sized by whole sessions (kv/policy.LoopShape with kv/budget.py's admission): where the
engine is the loops' bottleneck, a new session starts only when the sessions already here still
fit at the size sessions end at; where the clients' pauses dominate, one turn's growth is kept.
How many turns chains run (kv/policy.ChainLengths). Pure logic on a fake clock."""

import pytest

from cluster.engines.kv.budget import BudgetPolicy, KvBudget
from cluster.engines.kv.policy import ChainLengths, LoopShape, SessionHold


def replica_that_saw_a_session_end(turn_s: float, pause_s: float) -> KvBudget:
    """A replica where one session ran two turns of `turn_s` with a pause of `pause_s` between
    them, grew from 200 to 500 tokens and closed its socket."""
    b = KvBudget(1100, BudgetPolicy(ttl_initial_s=1000, ttl_min_s=1000, ttl_max_s=2000, max_queue_wait_s=60))
    t, _ = b.request("old", 200, 0)
    b.finish(t, held=200, expect_back=True, now=turn_s)
    t, _ = b.request("old", 500, turn_s + pause_s)
    b.finish(t, held=500, expect_back=True, now=2 * turn_s + pause_s)
    b.release("old", 2 * turn_s + pause_s)
    return b


def test_an_engine_bound_replica_admits_new_sessions_only_as_far_as_they_fit_at_their_end():
    b = replica_that_saw_a_session_end(turn_s=10, pause_s=1)
    assert b.shape.ended_tokens == 500 and b.shape.engine_share == pytest.approx(10 / 11)
    now = 30
    a, _ = b.request("a", 100, now)
    c, admitted = b.request("b", 100, now)
    assert admitted == [c]  # a and b grow to 500 each: 1,000 of 1,100
    d, admitted = b.request("c", 100, now)
    assert admitted == [] and d in b.queue  # c would grow to 500 too: the next wave
    assert b.snapshot(now)["growth_room_tokens"] == 800
    assert b.finish(a, held=500, expect_back=False, now=40) == [d]  # a ended: c starts in its place


def test_between_the_residents_turns_a_new_session_waits_for_their_pause_not_past_their_growth():
    # a and b (turns of 10 s, pauses of 1 s: engine-bound) both between turns: nothing runs. c
    # let in now would grow with them past the pool and force one of them out (a whole
    # re-prefill); the engine idles for a pause at most. Once that pause is over with nobody
    # back, the idle engine takes c (counted: over_wave).
    b = replica_that_saw_a_session_end(turn_s=10, pause_s=1)
    b.observe_prefill(100, 2.0)  # a slow engine: a session of 500 tokens computes again in 10 s, a turn
    assert b.shape.pause_s == pytest.approx(1.0)
    a, _ = b.request("a", 100, 30)
    c, _ = b.request("b", 100, 30)
    b.finish(a, held=200, expect_back=True, now=40)
    b.finish(c, held=200, expect_back=True, now=40.5)
    new, admitted = b.request("c", 100, 40.6)
    assert admitted == [] and b.next_deadline() == pytest.approx(41.5)  # b's pause, at the replica's mean
    back, admitted = b.request("a", 300, 41.0)  # a is back within it: a runs, c still waits
    assert admitted == [back] and b.tick(41.6) == []
    b.finish(back, held=300, expect_back=True, now=51)
    assert b.tick(51.5) == [] and b.tick(52.1) == [new] and b.counters.over_wave == 1


def test_where_pauses_dominate_every_session_starts_with_one_turns_growth_kept_free():
    # The same sessions with turns a tenth of the pauses (a GPU's speed): one more session
    # running is throughput, and a dropped prefix a fast re-prefill. All three start.
    b = replica_that_saw_a_session_end(turn_s=0.1, pause_s=1)
    assert b.shape.engine_share == pytest.approx(0.1 / 1.1)
    admitted = [b.request(k, 100, 30)[1] for k in "abc"]
    assert all(admitted) and b.snapshot(30)["growth_room_tokens"] == 900  # 300 a turn x 3


def test_sessions_that_expire_unused_teach_the_end_size_too():
    shape = LoopShape()
    assert shape.to_end(resident=4, used=100, prefill_tps=None) == 0  # nothing seen: nothing reserved
    b = KvBudget(1000, BudgetPolicy(ttl_initial_s=5, ttl_min_s=5, ttl_max_s=5))
    t, _ = b.request("http-chain", 300, 0)
    b.finish(t, held=300, expect_back=True, now=1)
    b.tick(now=10)
    assert b.counters.expired == 1 and b.shape.ended_tokens == 300


@pytest.mark.parametrize("engine_bound", [True, False])
def test_a_new_session_on_a_busy_engine_bound_replica_waits_rather_than_take_a_soft_retention(engine_bound):
    # A stored chain's first turn is kept softly (no sign it will be back). Where turns outlast
    # the pauses, a newcomer that took its room while another session runs would only trade
    # places with it (it is back within its pause, as a newcomer): it waits for the wave. Where
    # pauses dominate, the newcomer's turn is throughput: it takes the soft room at once.
    b = replica_that_saw_a_session_end(turn_s=10, pause_s=1) if engine_bound else \
        replica_that_saw_a_session_end(turn_s=0.1, pause_s=1)
    t, _ = b.request("chain", 400, 30)
    b.finish(t, held=400, expect_back=False, now=31, continuable=True)
    assert b.sessions["chain"].soft
    b.request("running", 300, 31)
    new, admitted = b.request("new", 500, 32)  # 700 held + 500 > 1,100
    assert (new in admitted) is not engine_bound
    assert ("chain" in b.retained_sessions()) is engine_bound


def test_the_end_size_rises_to_a_larger_end_at_once_and_falls_slowly_to_smaller_ones():
    # A wave sized by the mean would outgrow the pool when its sessions end above it; an expiry
    # mid-session (a 1,000-token chain whose pause outlasted its TTL) is not an end.
    shape = LoopShape()
    shape.observe_end(4000)
    shape.observe_end(5000)
    assert shape.ended_tokens == 5000
    shape.observe_end(1000)
    assert shape.ended_tokens == pytest.approx(4600)
    shape.observe_end(5000)
    assert shape.ended_tokens == 5000


def test_chain_lengths_learn_where_chains_end_and_take_back_an_end_that_was_a_long_pause():
    lengths = ChainLengths()
    assert lengths.chance(5, prior=0.8) == pytest.approx(0.8)  # nothing seen: the replica's record
    holds = [SessionHold(key=str(i)) for i in range(4)]
    for h in holds:
        for turns in range(1, 5):
            lengths.observe_return(h, turns)  # each came back after its 1st..4th turn
        lengths.observe_end(h, 5)
    lengths.observe_end(holds[0], 5)  # counted once per end
    assert lengths.chance(5, prior=0.8) == pytest.approx(0.8 / 5) and lengths.likely_ended(5)
    assert lengths.chance(3, prior=0.8) == pytest.approx(4.8 / 5) and not lengths.likely_ended(3)
    # two of them were only pausing past their TTL: back after 5 turns, the end taken back
    lengths.observe_return(holds[0], 5)
    lengths.observe_return(holds[1], 5)
    assert lengths.ended[5] == 2 and lengths.went_on[5] == 2 and not lengths.likely_ended(5)


def test_chain_lengths_hold_a_bounded_number_of_counts_however_long_chains_run():
    lengths = ChainLengths()
    for turns in range(1, 100_000, 7):
        lengths.observe_end(SessionHold(), turns)
    assert len(lengths.ended) <= ChainLengths.EXACT + 20
    assert lengths.bucket(40) == lengths.bucket(50) != lengths.bucket(70)


@pytest.mark.parametrize("prefill_tps, waits_for_wave", [(100.0, True), (100_000.0, False)])
def test_a_new_session_waits_for_a_wave_only_where_a_reprefill_costs_more_than_a_turn(prefill_tps, waits_for_wave):
    # Turns outlast the pauses: the engine is the loops' bound. Sessions end at 500 tokens and a
    # turn takes 2 s: at 100 tokens/s a re-prefill takes 5 s, longer than a turn (waves); at
    # 100,000 tokens/s 5 ms: holding a newcomer for a wave (60 s here) would cost more than the
    # prefix it saves, so it waits only by the cost rule and nothing is sized to the ends.
    b = replica_that_saw_a_session_end(turn_s=10, pause_s=1)
    b.shape.turn_s = 2.0  # turns measured at 2 s (the moving average)
    b.observe_prefill(10 * int(prefill_tps), 10.0)
    assert b.shape.waves(b.prefill_tps) is waits_for_wave
    r, _ = b.request("r", 300, 30)  # runs
    a, _ = b.request("a", 400, 30)
    t, _ = b.request("kept", 400, 30)
    b.finish(t, held=400, expect_back=True, now=31)  # retained between turns
    new, admitted = b.request("new", 400, 32)  # 300 + 400 + 400 + 400 > 1,100
    assert new not in admitted
    deadline = b.next_deadline()
    if waits_for_wave:
        assert deadline == pytest.approx(32 + 60) and b.snapshot(32)["growth_room_tokens"] > 0
    else:
        assert deadline < 32.01 and b.tick(32.01) == [new] and set(b.retained_sessions()) == set()


def agent_sessions_started_together(b: KvBudget, sessions: int, turns: int, growth: int) -> int:
    """`sessions` agent loops (no pause to speak of) started at once on `b`, each turn adding
    `growth` tokens; a turn runs 0.3 s plus its uncached tokens at 200 tokens/s (a slow engine:
    the loops wait on it). Returns the turns that prefilled a history their session had lost."""
    import heapq

    events, held, left, tickets, lost = [], {}, {}, {}, 0
    for i in range(sessions):
        held[f"s{i}"], left[f"s{i}"] = 0, turns
        heapq.heappush(events, (0.001 * i, i, "ask", f"s{i}"))
    seq = sessions

    def run(admitted, now):
        nonlocal seq, lost
        for t in admitted:
            s = tickets[t]
            lost += bool(held[s]) and not b.sessions[s].retained
            uncached = growth + (0 if b.sessions[s].retained else held[s])
            seq += 1
            heapq.heappush(events, (now + 0.3 + uncached / 200, seq, "done", t))

    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "ask":
            t, admitted = b.request(item, held[item] + growth, now)
            tickets[t] = item
        elif kind == "done":
            s = tickets.pop(item)
            held[s] += growth
            left[s] -= 1
            admitted = b.finish(item, held[s], expect_back=bool(left[s]), now=now, close_tells_end=True)
            if left[s]:
                seq += 1
                heapq.heappush(events, (now + 0.01, seq, "ask", s))
            else:
                admitted += b.release(s, now)
        else:
            admitted = b.tick(now)
        run(admitted, now)
        deadline = b.next_deadline()
        if deadline is not None and deadline > now:
            seq += 1
            heapq.heappush(events, (deadline, seq, "tick", None))
        if not tickets and not any(left.values()):
            break
    return lost


def test_sessions_that_start_together_and_outgrow_the_pool_are_set_aside_whole_before_any_ended_here():
    """A fresh replica (only a warm-up's small session ended here) gets 8 agent sessions at
    once; each ends at 385 tokens, the pool holds 1,000: three fit at their end. The live
    sessions' sizes are the end size's only sign: a session set aside for another's growth waits
    for sessions to end, not for the moment's room (with the warm-up's end size alone, a session
    came back on that room and was forced out again: 49 of 88 turns lost their history)."""
    b = KvBudget(1000, BudgetPolicy(retention=True))
    b.observe_prefill(200, 1.0)
    b.shape.observe_end(5)  # the warm-up
    lost = agent_sessions_started_together(b, sessions=8, turns=11, growth=35)
    assert lost <= 8  # each session set aside at most once
    assert b.shape.ended_tokens == 350  # the largest a session expected back held
