"""What a default single-host `loopserve serve` leaves reachable from other machines.

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

from tests.support.local_cluster import free_port
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


# A method of each gRPC service Ray listens with (a server answers UNIMPLEMENTED for the others):
# Serve replicas' ASGI service, core workers, the raylet, GCS, the dashboard agent, the object
# manager, the event aggregator.
METHODS = ("/ray.serve.ASGIService/HandleRequest", "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
           "/ray.rpc.NodeManagerService/GetNodeStats", "/ray.rpc.NodeInfoGcsService/GetClusterId",
           "/ray.rpc.ReporterService/HealthCheck", "/ray.rpc.LogService/ListLogs",
           "/ray.rpc.ObjectManagerService/Pull", "/ray.rpc.events.EventAggregatorService/AddEvents")


def answer_without_token(ip: str, port: int) -> str:
    """What a caller without Ray's token gets from the server at ip:port: a gRPC status, `HTTP <status>`
    for an HTTP server, or `metrics` for Ray's Prometheus exporter (read-only metrics text)."""
    import grpc
    import httpx

    host = "127.0.0.1" if ip in ("0.0.0.0", "::") else f"[{ip}]" if ":" in ip else ip
    codes = []
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        for method in METHODS:
            call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            try:
                call(b"", timeout=10)
                return f"OK {method}"
            except grpc.RpcError as err:
                codes.append(err.code().name)
            if codes[-1] not in ("UNIMPLEMENTED",):
                break
    if codes[-1] != "UNAVAILABLE":  # a gRPC server: its answer to the first method it has
        return codes[-1]
    r = httpx.get(f"http://{host}:{port}/", timeout=10)  # not gRPC: an HTTP server
    return "metrics" if r.status_code == 200 and r.text.startswith("# HELP") else f"HTTP {r.status_code}"


def test_a_single_host_start_keeps_to_loopback_and_what_ray_opens_wider_wants_its_token(tmp_path: Path):
    env_before = os.environ.get("RAY_AUTH_MODE")
    server = Server(ROOT / "serve_configs/scripted.yaml", free_port(), free_port(), tmp_path / "serve.log")
    try:
        server.wait_ready()
        sockets = listening(server.proc.pid)
        http_port = int(server.base.rsplit(":", 1)[1])
        assert ("127.0.0.1", http_port) in {(ip, port) for ip, port, _ in sockets}  # the ingress: loopback
        wide = [(ip, port, name) for ip, port, name in sockets if not ipaddress.ip_address(ip).is_loopback]
        # Whatever listens beyond loopback is one of Ray's servers (Ray binds the replicas' gRPC servers on
        # every interface and never takes loopback as a node's address) and refuses a caller without the
        # cluster's token, or is Ray's read-only Prometheus exporter; anything else there (the engine's
        # direct channel on the LAN address, a server without token auth) fails this.
        answers = {f"{ip}:{port} {name}": answer_without_token(ip, port) for ip, port, name in wide}
        assert answers and all(code in ("UNAUTHENTICATED", "HTTP 401", "metrics") for code in answers.values()), \
            "\n".join(f"{k}: {v}" for k, v in answers.items())
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=120)
    assert os.environ.get("RAY_AUTH_MODE") == env_before  # the test process's own Ray is untouched
