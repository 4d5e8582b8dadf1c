"""Multi-node on one machine: 3 Ray nodes, the engine node killed, sessions recover on a new node.

The scenario runs in its own process (its own Ray cluster, `ray.cluster_utils.Cluster`),
so the suite's Ray instance is untouched; see `multinode_scenario.py`.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def test_sessions_recover_when_the_engine_node_dies(tmp_path):
    out = tmp_path / "multinode.json"
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.multinode_scenario", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    nodes = report["nodes"]
    # Connection actors and engines were on different nodes; the engine moved to the new node.
    assert report["engine_nodes_before"] == [nodes["engine"]]
    assert report["engine_nodes_after"] == [nodes["new_engine"]]
    assert nodes["cpu"] not in report["engine_nodes_after"]
    for s in report["sessions"]:
        assert s["done"] == 8, report["sessions"]  # every session finished every turn
    assert report["completed_after_kill"] >= 4
    # What failed during the outage failed cleanly: a retryable server_error, never a hang.
    for e in report["log"]:
        if e["type"] in ("response.failed", "error"):
            assert e["code"] in ("server_error", "previous_response_not_found"), e
