"""The KV grid's verdict per cell: medians over rounds, on against off, and the worst round's ratio
to its alternating partner (a policy that loses one round badly shows there, not hidden by medians)."""

from cluster.bench.kv_grid import lower_bound, table


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
