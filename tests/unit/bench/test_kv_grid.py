"""The KV grid's verdict per cell: medians over rounds, on against off, and the worst round's ratio
to its alternating partner (a policy that loses one round badly shows there, not hidden by medians)."""

from cluster.bench.kv_grid import lower_bound, runs, spreads, table


def row(rnd, policy, done, model="h100-8b", transport="ws"):
    return {"model": model, "round": rnd, "policy": policy, "transport": transport, "all_done_s": done, "hit": 0.5,
            "prefilled_tokens": 1000, "turn_p99_s": 1.0, "lower_bound_s": 2.0}


def test_a_cell_reports_median_ratio_and_the_worst_rounds():
    rows = [row(0, True, 50), row(0, False, 50), row(1, True, 88), row(1, False, 49), row(2, True, 52), row(2, False, 63)]
    line = table(rows).splitlines()[2]
    assert line.startswith("h100-8b | ws | 52.0 / 50.0 | 1.04 | 1.80 |")


def test_the_lower_bound_is_slower_on_the_cpu_and_for_longer_contexts():
    short = {"necessary_tokens": 50_000, "turns": 100}
    long = {"necessary_tokens": 300_000, "turns": 100}
    gpu = lower_bound("h100-8b", short, 10, 10, 16, 1)
    assert 0 < gpu < lower_bound("cpu", short, 10, 10, 16, 1)
    # 6x the tokens a turn: more than 6x the prefill (attention over the longer context)
    assert lower_bound("h100-8b-long", long, 10, 10, 0, 1) > 6 * lower_bound("h100-8b", short, 10, 10, 0, 1)


def test_each_transport_runs_on_deployments_of_its_own_and_goes_first_in_turn():
    # one deployment serving the transports in turn taught the later ones what the first met cold
    plan = runs("h100-8b,cpu", 3, "ws,ws-reconnect,http")
    assert len(plan) == len(set(plan)) == 2 * 3 * 3  # a `sessions` run (fresh servers) per model, round, transport
    firsts = [next(p for p in plan if p[:2] == ("h100-8b", rnd))[2] for rnd in range(3)]
    assert firsts == ["ws", "ws-reconnect", "http"]
    # on and off alternate which goes first, and each run has both
    assert {p[3] for p in plan if p[1] == 0} == {"loopserve,loopserve-nobudget"}
    assert {p[3] for p in plan if p[1] == 1} == {"loopserve-nobudget,loopserve"}


def test_the_spread_across_transports_is_shown_per_round_and_policy():
    rows = [dict(row(0, True, 50, transport=t), hit=h) for t, h in (("ws", 0.80), ("http", 0.74))]
    rows += [dict(row(0, False, 50, transport=t), hit=h) for t, h in (("ws", 0.60), ("http", 0.70))]
    lines = spreads(rows).splitlines()
    assert lines[2] == "h100-8b | 0 | off | http 0.700 / ws 0.600 | 0.100"
    assert lines[3] == "h100-8b | 0 | on | http 0.740 / ws 0.800 | 0.060"
