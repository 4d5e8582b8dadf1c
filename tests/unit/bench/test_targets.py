"""The targets table judges each target from the measured numbers (no Ray)."""

from cluster.bench.targets import table


def test_targets_are_judged_from_the_run():
    m = {"loop": {"rounds": {"websocket": [{"loop_s": 5.3, "engine_s": 5.0, "overhead_p50_ms": 6.0},
                                            {"loop_s": 5.4, "engine_s": 5.0, "overhead_p50_ms": 6.5},
                                            {"loop_s": 6.0, "engine_s": 5.0, "overhead_p50_ms": 7.0}]},
                  "echo_floor": {"p50_ms": 0.25}},
         "load": {"turns_per_s": 80.0, "turn_latency_p99_ms": 1200.0, "turns_completed": 1500,
                  "turns_expected": 1500, "problems": {}},
         "real": {"floor": [0.1] * 50, "loopserve-ws": [0.104] * 50, "vllm-server": [0.12] * 50}}
    rows = {name: met for name, _, met in table(m)}
    assert rows["scripted WS loop / engine time <= 1.15x"]  # median 1.08x
    assert not rows["WS overhead p50 <= 2x a WS echo through the same ingress"]  # 6.5 ms vs 0.5 ms
    assert rows["real engine: 50-turn WS loop <= 1.05x the engine floor"]
    assert rows["real engine: WS turns 1-5 <= vLLM's own server"]
    assert not rows["load 300x5, safety on: >= 100 turns/s"]
    assert rows["load: p99 turn latency < 1.5 s (client)"] and rows["load: nothing lost"]
