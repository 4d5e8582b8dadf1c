"""The HAProxy ingress (loopserve's default for `loopserve serve`, the image and the RayService):
WebSocket mode, HTTP stickiness by `x-session-id` and drain through it.

Runs in its own process and Ray cluster (HAProxy is a cluster-wide setting); see
`haproxy_scenario.py`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def test_websockets_http_stickiness_and_drain_through_haproxy(tmp_path):
    out = tmp_path / "haproxy.json"
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.haproxy_scenario", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["haproxy_processes"] >= 1  # the ingress really is HAProxy
    assert report["websocket"] == ["completed"] * 5
    # The client offered permessage-deflate; the ingress does not negotiate it (a client's 1 KB
    # inflated to 340 KB frames the replica decoded before any limit could refuse them).
    assert report["websocket_extensions"] == [None]
    # HAProxy hashes x-session-id: all 8 HTTP turns of the session reached the same one of the
    # two connection replicas (the one holding its chain in memory), and so does every later
    # request with that header.
    # A client sending invalid frames and reading none of their errors is cut: a send it takes
    # nothing of for `websocket.send_stall_seconds` resets the connection (a close frame would
    # wait behind what it has not read, and uvicorn's close waits for that to drain, for ever).
    assert report["flood"]["closed"], report["flood"]
    chain = report["http_chain"]
    assert chain["codes"] == [200] * 8
    assert chain["ids_on_session_replica"] == [8, 8, 8], chain
    for log in report["drain"]:
        assert log["close_error"] == "websocket_connection_limit_reached", log
        assert log["close_code"] == 1001, log
        assert log["created_without_terminal"] == [], log
        assert log["after_reconnect"] == "response.completed" and log["continues"], (log.get("error"), log)
