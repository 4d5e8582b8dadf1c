"""The bench's reading of a py-spy timeline: the event loop's longest busy runs."""

import json

from cluster.bench.loop_trace import busy_runs


def frames(tid: int, ts: int, names: list[tuple[str, str]], end: int) -> list[dict]:
    opened = [{"ph": "B", "tid": tid, "ts": ts, "name": n, "args": {"filename": f, "line": 1}} for n, f in names]
    closed = [{"ph": "E", "tid": tid, "ts": end, "name": n, "args": {}} for n, _ in reversed(names)]
    return opened + closed


def test_callbacks_back_to_back_are_one_run_named_by_what_took_its_time(tmp_path):
    base = [("thread (1): AsyncIO Thread", ""), ("Thread._bootstrap", "threading.py"),
            ("Thread._bootstrap_inner", "threading.py"), ("Thread.run", "threading.py")]
    events = []
    # 0-300 ms: two callbacks 5 ms apart (one run); 900-950 ms: another, alone.
    events += frames(1, 0, base + [("run_lane", "/x/cluster/core/websocket/session.py"),
                                   ("load_event", "/x/cluster/protocol/request_bounds.py")], 200_000)
    events += frames(1, 205_000, base + [("call_asgi", "/x/ray/serve/replica.py")], 300_000)
    events += frames(1, 900_000, base + [("call_asgi", "/x/ray/serve/replica.py")], 950_000)
    events += frames(2, 0, [("thread (2): other", ""), ("Thread.run", "threading.py")], 10_000)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(events))
    report = busy_runs(trace, top=2)
    first, second = report["runs"]
    assert (first["at_s"], first["ms"]) == (0.0, 300) and (second["at_s"], second["ms"]) == (0.9, 50)
    assert first["callbacks_ms"] == {"run_lane": 200, "call_asgi": 95}
    assert first["own_frames_ms"] == {"load_event (request_bounds.py:1)": 200}
    assert report["runs_over_100ms"] == 1 and report["busy_s"] == 0.35
