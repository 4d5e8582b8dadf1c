"""What a default single-host `loopserve serve` leaves reachable from other machines (issue 46, N4).

A Serve replica's gRPC server unpickles the request metadata it is sent, and Ray binds those
servers on every interface whatever the node's address. So the start must keep everything it can
on loopback, and what Ray still opens must refuse a caller without the cluster's token.
"""

from __future__ import annotations

import ipaddress
import os
import signal
from pathlib import Path

import psutil
import pytest

from cluster.bench.local import free_port
from tests.support.serve_process import ROOT, Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def listening(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket the process and its descendants listen on."""
    root = psutil.Process(pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="tcp")
            name = " ".join(proc.cmdline())[:80]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def answer_without_token(ip: str, port: int) -> str:
    """The gRPC status a caller without Ray's token gets from the server at ip:port (any method:
    the token is checked before the method is looked up). Not a gRPC server: UNAVAILABLE."""
    import grpc

    host = "127.0.0.1" if ip in ("0.0.0.0", "::") else f"[{ip}]" if ":" in ip else ip
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(b"", timeout=10)
        except grpc.RpcError as err:
            return err.code().name
    return "OK"


def test_a_single_host_start_keeps_to_loopback_and_what_ray_opens_wider_wants_its_token(tmp_path: Path):
    env_before = os.environ.get("RAY_AUTH_MODE")
    server = Server(ROOT / "serve_configs/scripted.yaml", free_port(), free_port(), tmp_path / "serve.log")
    try:
        server.wait_ready()
        sockets = listening(server.proc.pid)
        http_port = int(server.base.rsplit(":", 1)[1])
        assert ("127.0.0.1", http_port) in {(ip, port) for ip, port, _ in sockets}  # the ingress: loopback
        wide = [(ip, port, name) for ip, port, name in sockets if not ipaddress.ip_address(ip).is_loopback]
        # Whatever listens beyond loopback is one of Ray's gRPC servers (Ray binds the replicas' on
        # every interface) and refuses a caller without the cluster's token; anything else there
        # (the engine's direct channel on the LAN address, a server without token auth) fails this.
        answers = {f"{ip}:{port} {name}": answer_without_token(ip, port) for ip, port, name in wide}
        assert all(code == "UNAUTHENTICATED" for code in answers.values()), answers
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=120)
    assert os.environ.get("RAY_AUTH_MODE") == env_before  # the test process's own Ray is untouched
