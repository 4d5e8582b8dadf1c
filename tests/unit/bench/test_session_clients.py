"""The many-sessions benchmark's client shapes (cluster/bench/session_clients.py) and trace pauses."""

import random
import statistics

from cluster.bench.session_clients import SessionPlan, turn_body
from cluster.bench.sessions import TRACE_TOOL, trace_pause


def test_an_agent_turn_answers_the_models_last_calls_and_a_plain_turn_adds_a_message():
    plan = SessionPlan("s", "http://x", "m", 0, 1, transport="http", shape="agent", ttl="30m")
    first = turn_body(plan, "start", None, 16)
    assert first["input"] == "start" and first["store"] and first["tools"][0]["name"] == "run_tests"
    assert first["prompt_cache_options"] == {"ttl": "30m"} and "previous_response_id" not in first
    prev = {"id": "resp_1", "output": [{"type": "function_call", "call_id": "c1", "name": "run_tests", "arguments": "{}"}]}
    body = turn_body(plan, "3 passed", prev, 16)
    assert body["previous_response_id"] == "resp_1"
    assert body["input"] == [{"type": "function_call_output", "call_id": "c1", "output": "3 passed"}]
    answered = {"id": "resp_2", "output": [{"type": "message", "content": []}]}
    assert turn_body(plan, "next", answered, 16)["input"] == "next"
    ws = turn_body(SessionPlan("s", "u", "m", 0, 1), "x", prev, 16)
    assert ws["input"] == "x" and not ws["store"] and "tools" not in ws  # a held socket, store: false


def test_trace_pauses_follow_the_published_medians_scaled():
    rng = random.Random(1)
    pauses = [trace_pause(rng, 1.0) for _ in range(4000)]
    # 90% tool pauses (median 0.3 s), 10% human waits (median 84 s): the overall median sits just above 0.3 s
    assert TRACE_TOOL[0] * 0.8 < statistics.median(pauses) < TRACE_TOOL[0] * 2.5
    assert sum(p > 30 for p in pauses) > 0.03 * len(pauses)  # the human waits are there
    assert max(trace_pause(random.Random(2), 0.05) for _ in range(2000)) <= 60.0
