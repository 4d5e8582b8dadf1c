"""`loopserve bench <name>`: every benchmark is reachable by its name with its own options."""

import pytest

from cluster import cli
from cluster.bench.commands import BENCHMARKS


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_answers_help_under_its_name(name, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", name, "--help"])
    assert done.value.code == 0
    assert f"loopserve bench {name}" in capsys.readouterr().out  # its own parser, named for the command


def test_the_list_and_an_unknown_name(capsys):
    assert cli.main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in BENCHMARKS)
    assert cli.main(["bench", "no-such-bench"]) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err


def test_options_first_still_run_the_agent_loop(monkeypatch):
    """`loopserve bench --turns 50 --modes websocket` (README, docs) kept its meaning."""
    import cluster.bench.runner as runner

    seen = []
    monkeypatch.setattr(runner, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--turns", "5", "--modes", "websocket"]) == 0
    assert cli.main(["bench"]) == 0 and seen == [["--turns", "5", "--modes", "websocket"], []]


def test_other_commands_still_refuse_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["make-model", "--bogus"])
    assert done.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
