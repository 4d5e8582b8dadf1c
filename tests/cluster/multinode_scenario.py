"""A 3-node Ray cluster on this machine: sessions survive losing the engine node.

    python -m tests.cluster.multinode_scenario --out result.json

Head (Serve controller + proxy), a CPU node (`loopserve_cpu_node`: connection,
render, safety) and an engine node (`loopserve_engine_node`: the engine). Agent
sessions run over WebSockets with `store: true`; the engine node is killed
mid-turn and a new engine node joins; every session must finish its turns on
the engine replica Serve starts on the new node. Runs in its own process (its
own Ray cluster), so the test suite's Ray instance is untouched. Prints and
writes a JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

from tests.support.ws import TERMINAL, ws_url

SESSIONS = 4


async def session(url: str, n: int, turns: int, log: list) -> dict:
    from websockets.asyncio.client import connect

    out = {"completed": 0, "failed": 0, "errors": 0, "reconnects": 0}
    prev = None
    done = 0
    deadline = time.time() + 240
    while done < turns and time.time() < deadline:
        try:
            async with connect(ws_url(url), open_timeout=60, close_timeout=5,
                               additional_headers={"x-session-id": f"multinode-{n}"}) as ws:
                while done < turns:
                    body = {"type": "response.create", "model": "loopserve-tiny", "store": True,
                            "input": f"session {n} turn {done}"}
                    if prev:
                        body["previous_response_id"] = prev
                    await ws.send(json.dumps(body))
                    created = False
                    while True:
                        ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
                        created = created or ev["type"] == "response.created"
                        # An error after response.created is followed by response.failed.
                        if ev["type"] in TERMINAL or (ev["type"] == "error" and not created):
                            break
                    log.append({"t": time.time(), "session": n, "type": ev["type"],
                                "code": (ev.get("error") or (ev.get("response") or {}).get("error") or {}).get("code")})
                    if ev["type"] == "response.completed":
                        prev = ev["response"]["id"]
                        out["completed"] += 1
                        done += 1
                    elif ev["type"] == "response.failed":
                        out["failed"] += 1  # retryable server_error: send the same turn again
                        await asyncio.sleep(1)
                    else:
                        out["errors"] += 1
                        await asyncio.sleep(1)
        except Exception as exc:  # the socket itself failed: reconnect and continue from the store
            out["reconnects"] += 1
            log.append({"t": time.time(), "session": n, "type": "reconnect", "code": type(exc).__name__})
            await asyncio.sleep(1)
    out["done"] = done
    return out


def engine_nodes(url: str) -> list[str]:
    """The node the engine replica runs on, as it reports itself (`/loopserve/stats`)."""
    from tests.support.local_cluster import stats as server_stats

    return [server_stats(url, last=1)["engine"]["node"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="multinode.json")
    ap.add_argument("--turns", type=int, default=8)
    ns = ap.parse_args(argv)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # else the driver hangs on 192.0.2.2 (NOTES)
    from cluster.ingress.modes import apply_ingress_env

    apply_ingress_env("haproxy")  # loopserve's default ingress, as `loopserve serve` and infra/ run it
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from tests.support.local_cluster import deploy, free_port

    temp = tempfile.mkdtemp(prefix="loopserve-mn-")
    # Ray writes its address file under RAY_TMPDIR/ray: keep it out of the shared /tmp/ray.
    os.environ["RAY_TMPDIR"] = temp
    os.makedirs(os.path.join(temp, "ray"), exist_ok=True)
    report: dict = {"nodes": {}}
    # Never Redis's 6379: the head's GCS gets a free port.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "gcs_server_port": free_port(),
                                                            "include_dashboard": False})
    try:
        cpu_node = cluster.add_node(num_cpus=1, resources={"loopserve_cpu_node": 100})
        engine_node = cluster.add_node(num_cpus=1, resources={"loopserve_engine_node": 100})
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        base = f"http://127.0.0.1:{port}"
        on_cpu = {"ray_actor_options": {"num_cpus": 0.1, "resources": {"loopserve_cpu_node": 1}}}
        args = {
            "engine": {"backend": "scripted", "scripted": {"tokens_per_second": 40}},
            "store": {"backend": "sqlite", "sqlite_path": os.path.join(temp, "responses.db")},
            "routing": {"engine_retries": 6},
            "connection": on_cpu, "render": on_cpu, "safety": {"deployment": on_cpu},
            "engine_deployment": {"ray_actor_options": {"num_cpus": 0.1, "resources": {"loopserve_engine_node": 1}}},
        }
        url = deploy(base, "mn", "/", args, timeout=300)
        report["nodes"] = {"cpu": cpu_node.node_id, "engine": engine_node.node_id}
        report["engine_nodes_before"] = engine_nodes(url)

        # Sessions run on a thread's event loop; node changes must happen on the main thread.
        import threading

        log: list = []
        results: list = []

        async def run() -> None:
            results.extend(await asyncio.gather(*[session(url, n, ns.turns, log) for n in range(SESSIONS)]))

        runner = threading.Thread(target=lambda: asyncio.run(run()))
        runner.start()
        # Let every session finish a few turns, then kill the engine node mid-turn.
        deadline = time.time() + 120
        while sum(e["type"] == "response.completed" for e in list(log)) < SESSIONS * 2 and time.time() < deadline:
            time.sleep(0.2)
        report["killed_at"] = time.time()
        cluster.remove_node(engine_node, allow_graceful=False)
        new_node = cluster.add_node(num_cpus=1, resources={"loopserve_engine_node": 100})
        report["nodes"]["new_engine"] = new_node.node_id
        runner.join(timeout=400)
        report["sessions"] = results
        report["log"] = log
        report["engine_nodes_after"] = engine_nodes(url)
        report["cpu_node_actors_alive"] = True
        after = [e for e in report["log"] if e["t"] > report["killed_at"] and e["type"] == "response.completed"]
        report["completed_after_kill"] = len(after)
        first_ok = min((e["t"] for e in after), default=None)
        report["recovery_s"] = (first_ok - report["killed_at"]) if first_ok else None
    finally:
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            cluster.shutdown()
    text = json.dumps(report, indent=1)
    with open(ns.out, "w") as f:
        f.write(text)
    summary = {k: v for k, v in report.items() if k != "log"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
