"""`loopserve serve` as its own process (its own Ray cluster, its own session), as an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from tests.support.local_cluster import free_port

ROOT = Path(__file__).resolve().parents[2]


class Server:
    def __init__(self, config: Path, port: int, stats_port: int, log: Path, env: Optional[dict] = None) -> None:
        # HAProxy's stats and metrics ports of its own: another cluster on the machine may hold the defaults.
        env = {**os.environ, "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
               "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()), **(env or {})}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster", "serve", "--config", str(config), "--port", str(port), "--num-cpus", "2"],
            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            if "loopserve: serving" not in self.log.read_text():  # this server's, not a leftover's answer
                time.sleep(0.5)
                continue
            try:
                if httpx.get(self.base + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("not ready: " + self.log.read_text()[-3000:])
