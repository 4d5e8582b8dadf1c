"""What a turn asks of the KV budget (cluster/engines/kv/accounting.py): shared heads, bounded."""

from array import array

from cluster.engines.kv.accounting import OutputReserve, SharedHeads


def toks(seed: int, n: int) -> array:
    return array("i", [(seed * 1_000_003 + i) % 50_000 for i in range(n)])


def test_a_tenants_kinds_of_agent_each_get_a_head_and_tenants_never_share_one():
    heads = SharedHeads(block=16)
    coder, reviewer = toks(1, 320), toks(2, 320)
    g1, n1 = heads.shared("t", coder + toks(10, 50))
    g2, n2 = heads.shared("t", reviewer + toks(11, 50))
    assert g1 != g2 and (n1, n2) == (368, 368)  # each became a head (all but the partial block)
    assert heads.shared("t", coder + toks(12, 99)) == (g1, 320)
    assert heads.shared("t", reviewer + toks(13, 5)) == (g2, 320)
    other, _ = heads.shared("u", coder + toks(12, 99))
    assert other not in (g1, g2)  # another tenant's blocks hash with its own salt


def test_heads_are_bounded_in_number_and_length():
    heads = SharedHeads(block=16)
    for i in range(SharedHeads.MAX_HEADS + 50):
        heads.shared(f"tenant{i}", toks(i, 20_000))
    assert heads.nbytes <= SharedHeads.MAX_HEADS * SharedHeads.MAX_HEAD_TOKENS * 4
    for i in range(10):
        heads.shared("one", toks(1000 + i, 100))
    assert len(heads._by_tenant["one"]) == SharedHeads.PER_TENANT


def test_output_reservations_forget_old_sessions():
    reserve = OutputReserve()
    reserve.MAX_SESSIONS = 3
    for s in "abcd":
        reserve.observe(s, 10)
    assert len(reserve._sessions) == 3 and reserve.reserve("a", 500) == 125  # a: new again (a quarter of its budget)
    assert reserve.reserve("d", 500) == 13  # d: its own outputs


def test_a_new_session_reserves_a_share_of_its_own_budget_whatever_others_produced():
    """A new session reserved 1.25x the replica's recent outputs, so clients sending
    tiny outputs taught the budget to reserve ~nothing for a `max_output_tokens: 30000` turn."""
    reserve = OutputReserve()
    for i in range(50):
        reserve.observe(f"tiny{i}", 2)
    assert reserve.reserve("newcomer", 30_000) == 7_500
    reserve.observe("newcomer", 40)
    assert reserve.reserve("newcomer", 30_000) == 50  # once it has turns, its own outputs decide
