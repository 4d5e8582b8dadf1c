"""Ray Serve's HAProxy ingress (loopserve's default ingress) in a Ray cluster of its own.

    python -m tests.cluster.haproxy_scenario --out result.json

HAProxy is a cluster-wide setting (read by Serve's controller and proxies at
start), so this runs in its own process and Ray cluster, started the way
`loopserve serve` starts one. Two connection replicas behind HAProxy:
- WebSocket mode: upgrades work, a `store: false` loop continues from the socket's cache;
- HTTP: a `store: false` chain keyed by `x-session-id` stays on one connection replica
  (its in-memory registry), so every continuation finds its parent;
- a client flooding invalid frames and reading nothing is closed;
- drain: a rolling redeploy under live sockets tells each to reconnect after its turn
  (`websocket_connection_limit_reached`, close 1001) and the chain continues.
Writes a JSON report; `test_haproxy.py` asserts on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from typing import Optional

from tests.support.ws import TERMINAL, flood_until_closed, ws_url


async def websocket_loop(url: str, turns: int, extensions: Optional[list] = None) -> list[str]:
    from websockets.asyncio.client import connect

    statuses = []
    prev = None
    async with connect(ws_url(url), open_timeout=60, close_timeout=5,  # offers permessage-deflate
                       additional_headers={"authorization": "Bearer sk-local", "x-session-id": "hap-ws"}) as ws:
        if extensions is not None:
            extensions.append(ws.response.headers.get("Sec-WebSocket-Extensions"))
        for n in range(turns):
            body = {"type": "response.create", "model": "loopserve-tiny", "store": False, "input": f"turn {n}"}
            if prev:
                body["previous_response_id"] = prev
            await ws.send(json.dumps(body))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if ev["type"] in TERMINAL or ev["type"] == "error":
                    break
            statuses.append(ev["type"] if ev["type"] == "error" else ev["response"]["status"])
            prev = (ev.get("response") or {}).get("id")
    return statuses


def http_chain(url: str, turns: int) -> dict:
    """A chain of HTTP turns under one `x-session-id`: which connection replica served each?"""
    import httpx

    from tests.support.local_cluster import admin_headers

    codes, ids = [], []
    prev = None
    session = {"x-session-id": "hap-http"}
    with httpx.Client(timeout=60) as client:
        for n in range(turns):
            body = {"model": "loopserve-tiny", "input": f"http turn {n}"}
            if prev:
                body["previous_response_id"] = prev
            r = client.post(url + "/v1/responses", json=body, headers=session)
            codes.append(r.status_code)
            prev = r.json().get("id") if r.status_code == 200 else prev
            ids.append(prev)
        # The stats route under the same header reaches the same replica: its recent turns
        # must be this whole chain (the other replica served none of it).
        seen = []
        for _ in range(3):
            r = client.get(url + "/loopserve/stats", params={"last": 200}, headers={**admin_headers(), **session})
            seen.append(sorted({t["response_id"] for t in r.json()["turns"]} & set(ids)))
    return {"codes": codes, "ids_on_session_replica": [len(s) for s in seen], "turns": len(ids)}


def haproxy_processes() -> int:
    """HAProxy processes on this machine (this scenario's cluster is the only one using it)."""
    out = subprocess.run(["ps", "-eo", "comm"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if "haproxy" in line.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="haproxy.json")
    ns = ap.parse_args(argv)

    from cluster.ingress.modes import apply_ingress_env

    apply_ingress_env("haproxy")
    import ray
    from ray import serve

    from tests.support.local_cluster import deploy, free_port
    from tests.integration.test_drain import agent, drain_args

    temp = tempfile.mkdtemp(prefix="loopserve-hap-")
    report: dict = {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        url = deploy(base, "hap", "/", drain_args(_Path(temp), 0), timeout=300)
        report["haproxy_processes"] = haproxy_processes()
        extensions: list = []
        report["websocket"] = asyncio.run(websocket_loop(url, 5, extensions))
        report["websocket_extensions"] = extensions
        report["http_chain"] = http_chain(url, 8)
        try:  # a client flooding invalid frames it never reads
            sent, seconds = asyncio.run(flood_until_closed(ws_url(url)))
            report["flood"] = {"closed": True, "frames": sent, "seconds": round(seconds, 1)}
        except (AssertionError, asyncio.TimeoutError) as exc:  # still open, or a send blocked past the deadline
            report["flood"] = {"closed": False, "why": repr(exc)}

        async def drain() -> list:
            agents = [asyncio.create_task(agent(url, n)) for n in range(3)]
            await asyncio.sleep(3)  # every agent is mid-loop
            await asyncio.to_thread(deploy, base, "hap", "/", drain_args(_Path(temp), 1), 300)
            return await asyncio.wait_for(asyncio.gather(*agents), 300)

        t0 = time.time()
        logs = asyncio.run(drain())
        report["drain_s"] = time.time() - t0
        report["drain"] = [{"completed": len(log["completed"]), "close_error": log["close_error"],
                            "close_code": log["close_code"], "created_without_terminal": log["created_without_terminal"],
                            "after_reconnect": log["after_reconnect"]["type"],
                            "error": log["after_reconnect"].get("error"),
                            "continues": (log["after_reconnect"].get("response") or {}).get("previous_response_id")
                            == (log["completed"] or [None])[-1]} for log in logs]
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


class _Path(str):
    def __truediv__(self, other: str) -> str:
        return os.path.join(self, other)


if __name__ == "__main__":
    raise SystemExit(main())
