"""`loopserve-haproxy` and the start-up port check, on real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.local_cluster import free_port
from cluster.ingress.haproxy import real_binary, secure_config
from cluster.ingress.stale import clear_ports, holders

pytestmark = pytest.mark.timeout(60)

RAY_STATS = """global
    maxconn 64
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend prometheus
    bind :{metrics}
    mode http
    no log
frontend http_frontend
    bind 127.0.0.1:{http}
    default_backend none
backend none
    http-request return status 200
listen stats
  bind *:{stats}
  stats enable
  stats uri /stats
  stats refresh 1s
"""


def test_the_stats_page_binds_loopback_or_goes_away():
    text = RAY_STATS.format(http=8000, stats=8404, metrics=9101)
    safe = secure_config(text)
    assert "bind 127.0.0.1:8404" in safe and "*:8404" not in safe
    assert "bind 127.0.0.1:9101" in safe and "bind :9101" not in safe
    assert "bind 127.0.0.1:8000" in safe  # the frontend is Serve's to choose
    off = secure_config(text, "off")
    assert "listen stats" not in off and "8404" not in off and "backend none" in off
    assert "bind :9101" not in secure_config(text, "public")  # the exporter has its own switch


def test_websocket_compression_is_not_negotiated_at_the_frontend_unless_asked_for(monkeypatch):
    text = RAY_STATS.format(http=8000, stats=8404, metrics=9101)
    safe = secure_config(text)
    frontend = safe.split("frontend http_frontend\n")[1].split("backend none")[0]
    assert "http-request del-header sec-websocket-extensions" in [line.strip() for line in frontend.splitlines()]
    assert secure_config(safe) == safe  # a reload rewrites the file again: one rule, not two
    monkeypatch.setenv("LOOPSERVE_HAPROXY_WS_COMPRESSION", "on")
    assert "sec-websocket-extensions" not in secure_config(text)


def test_a_websocket_s_frames_are_not_read_ahead_of_the_app():
    """Ray's replica drained a socket's frames into an unbounded queue ahead of the app (its
    disconnect watch); the frontend tells it not to, for upgrades only."""
    text = RAY_STATS.format(http=8000, stats=8404, metrics=9101)
    safe = secure_config(text)
    frontend = [line.strip() for line in safe.split("frontend http_frontend\n")[1].split("backend none")[0].splitlines()]
    assert "http-request set-header x-request-disconnect-disabled ?1 if { hdr(upgrade) -i websocket }" in frontend
    assert secure_config(safe).count("x-request-disconnect-disabled") == 1


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def holding(*ports: int) -> bool:
    return {h.port for h in holders(list(ports))} == set(ports)


def kill_quietly(pid: int) -> None:
    """Whatever happened in the test, nothing it started outlives it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve_config(tmp_path) -> tuple[Path, int, int]:
    """A config where Serve writes its own (`.../haproxy-serve/<node>/haproxy.cfg`), on free ports."""
    http, stats = free_port(), free_port()
    cfg_dir = tmp_path / "haproxy-serve" / "node"
    cfg_dir.mkdir(parents=True)
    cfg = cfg_dir / "haproxy.cfg"
    cfg.write_text(RAY_STATS.format(http=http, stats=stats, metrics=free_port()))
    return cfg, http, stats


def test_haproxy_started_through_the_launcher_stops_when_its_parent_dies(tmp_path):
    cfg, http, stats = serve_config(tmp_path)
    # The parent stands in for Serve's proxy actor: it starts HAProxy as Serve does, then is killed.
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'cluster.ingress.haproxy', '-db', '-f', {str(cfg)!r}])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    haproxy_pid = int(parent.stdout.readline())
    try:
        assert wait_for(lambda: holding(http, stats))
        assert "bind 127.0.0.1:" + str(stats) in cfg.read_text()  # rewritten before HAProxy read it
        assert all(h.name == "haproxy" and h.pid == haproxy_pid for h in holders([http, stats]))
        parent.kill()
        parent.wait()
        assert wait_for(lambda: not os.path.exists(f"/proc/{haproxy_pid}") or
                        Path(f"/proc/{haproxy_pid}/stat").read_text().split()[2] == "Z")
        assert wait_for(lambda: holders([http, stats]) == [])
    finally:
        parent.kill()
        kill_quietly(haproxy_pid)


def test_a_stale_serve_haproxy_is_stopped_and_any_other_holder_is_named(tmp_path):
    cfg, http, stats = serve_config(tmp_path)
    # An HAProxy of an earlier server, orphaned (its parent gone), started without the launcher.
    out = subprocess.run([sys.executable, "-c", (
        "import os, subprocess, sys\n"
        f"p = subprocess.Popen([{real_binary()!r}, '-db', '-f', {str(cfg)!r}], start_new_session=True,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n")], check=True, capture_output=True, text=True)
    orphan_pid = int(out.stdout)
    try:
        assert wait_for(lambda: holding(http, stats))
        orphan = holders([http])[0]
        assert orphan.pid == orphan_pid and orphan.stale_serve_haproxy
        assert clear_ports([http, stats]) is None
        assert holders([http, stats]) == []
    finally:
        kill_quietly(orphan_pid)

    other = socket.socket()
    other.bind(("127.0.0.1", http))
    other.listen()
    try:
        refused = clear_ports([http], wait_s=1)
        assert refused is not None and f"pid {os.getpid()}" in refused and str(http) in refused
    finally:
        other.close()


def test_an_orphaned_ray_worker_on_the_port_is_stopped(tmp_path):
    """After a SIGKILL of `loopserve serve`'s group, a Ray worker (a replica) can outlive its raylet
    for a while, its listener on the port the next start wants: that start stops it, not refuses.
    (Seen in CI: `port ... is in use by pid ... (ray::ServeRepli...)` right after the SIGKILL.)"""
    port = free_port()
    out = subprocess.run([sys.executable, "-c", (
        "import subprocess, sys\n"
        "code = ('import ctypes, socket, time\\n'\n"
        "        'ctypes.CDLL(None).prctl(15, b\"ray::ServeRepli\", 0, 0, 0)\\n'\n"
        f"        's = socket.socket(); s.bind((\"127.0.0.1\", {port})); s.listen(); time.sleep(60)')\n"
        "p = subprocess.Popen([sys.executable, '-c', code], start_new_session=True,\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n")], check=True, capture_output=True, text=True)
    orphan_pid = int(out.stdout)
    try:
        assert wait_for(lambda: holders([port]) != [])
        [orphan] = holders([port])
        assert orphan.pid == orphan_pid and orphan.name == "ray::ServeRepli" and orphan.stale
        assert clear_ports([port], wait_s=10) is None
        assert holders([port]) == []
    finally:
        kill_quietly(orphan_pid)


def test_an_ended_connection_reaches_a_client_that_reads_nothing_within_30_s():
    """The app ends a flooding socket; what HAProxy still holds for a client that reads nothing goes
    after client-fin, not after `timeout client` (an hour): the flood test through HAProxy saw the
    socket held open past 120 s without it."""
    safe = secure_config(RAY_STATS.format(http=8000, stats=8404, metrics=9101))
    frontend = [line.strip() for line in safe.split("frontend http_frontend\n")[1].split("backend none")[0].splitlines()]
    assert "timeout client-fin 30s" in frontend
    assert secure_config(safe).count("timeout client-fin") == 1
