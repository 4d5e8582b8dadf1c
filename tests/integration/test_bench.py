"""The agent-loop benchmark runs against the real app in every mode (so it cannot rot)."""

import asyncio
import re

import pytest

from cluster.bench.agent_loop import MODES, Loop, attach_server_timings, summarize
from cluster.bench.runner import echo_floor

pytestmark = pytest.mark.integration


def test_every_mode_runs_and_only_stateless_resends_history(scripted_url):
    summaries = {}
    for mode in MODES:
        turns = asyncio.run(Loop(scripted_url, mode, 4, 1000).run())
        attach_server_timings(scripted_url, turns)
        assert all(t.server for t in turns), "every turn has the server's own timing"
        summaries[mode] = summarize(mode, turns)
        per_turn = summaries[mode]["per_turn"]
        assert all(t["overhead_s"] is not None and t["overhead_s"] >= 0 for t in per_turn)
        assert per_turn[-1]["cached_tokens"] > 0
    sent = {m: [t["bytes_sent"] for t in s["per_turn"]] for m, s in summaries.items()}
    assert sent["http-stateless"][-1] > 2 * sent["http-stateless"][1]  # grows with history
    assert sent["websocket"][-1] < 1.2 * sent["websocket"][1]  # flat: only new items
    assert summaries["websocket"]["final_input_tokens"] > 1000


def test_echo_floor(scripted_url):
    floor = asyncio.run(echo_floor(scripted_url, n=50))
    assert 0 < floor["p50_ms"] < 1000


def test_an_app_whose_replica_cannot_start_fails_with_the_replicas_error(serve_instance, tmp_path):
    from tests.support.local_cluster import deploy
    from tests.support.apps import delete_in_background, scripted_app

    # A model folder with no tokenizer in it: the replicas that load one fail in their constructor,
    # once each (Serve would start each 3 times: `max_constructor_retry_count` reaches Serve).
    once = {"max_constructor_retry_count": 1}
    args = scripted_app(model={"path": str(tmp_path)}, connection=once, render=once, engine_deployment=once)
    try:
        with pytest.raises(RuntimeError) as failed:
            deploy(serve_instance, "no-tokenizer", "/no-tokenizer", args, timeout=120)
        message = str(failed.value)
        # The failed deployment named with its replica's own error, not only Serve's summary. Which of
        # the replicas that load a tokenizer gives up first is a race (the others may still be retrying).
        failed_deployments = re.findall(r"^(\w+) \(DEPLOY_FAILED\): ", message, re.MULTILINE)
        assert failed_deployments and set(failed_deployments) <= {"RenderActor", "EngineReplica", "ConnectionActor",
                                                                   "SafetyActor", "GuardEngine"}, message
        assert "Couldn't instantiate the backend tokenizer" in message, message
    finally:
        delete_in_background("no-tokenizer")
