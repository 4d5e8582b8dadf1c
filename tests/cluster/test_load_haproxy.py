"""The 1,000-session load target through loopserve's default ingress: 1,000 concurrent WebSocket
sessions x 10 turns through HAProxy, scripted engine, safety on, agent tool pauses of 3-9 s.
Nothing may be lost, duplicated or misrouted, and the 1,000 sessions idle between their turns
cost the connection replica what their caches hold plus the socket, nowhere near the cache
limits. (Its latency is the benchmark's to report:
`python -m cluster.bench.load --sessions 1000 --turns 10 --safety on --ingress haproxy --pause 3,9`;
the closed loop, every session sending at once, is `--pause 0,0`.)

Its own process and Ray cluster: HAProxy is a cluster-wide setting."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def test_thousand_agent_sessions_through_haproxy_with_safety_lose_nothing(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.bench.load", "--sessions", "1000", "--turns", "10",
                           "--safety", "on", "--ingress", "haproxy", "--pause", "3,9", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    print(proc.stdout[-600:])
    assert report["problems"] == {}
    assert report["turns_completed"] == 10_000
    assert report["idle_sockets"] >= 1000
    # Each idle session holds one cached response (its warm turn) and its socket.
    assert 0 < report["cache_bytes_per_idle_session"] < 64 * 1024
    assert report["rss_per_idle_session_bytes"] < 1024 * 1024
