"""Graceful drain: a redeploy (rolling restart) of a live app loses nothing.

Old connection replicas stop taking sockets, let each live socket finish the
turn in flight, then send `websocket_connection_limit_reached` and close 1001;
the client reconnects (to a new replica) and continues its `store: true` chain.
"""

import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.support.apps import delete_in_background, deploy_app
from tests.support.ws import TERMINAL, ws_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def drain_args(tmp_path, generation: int) -> dict:
    return {
        # ~1 s per turn, so redeploys land while turns are in flight.
        "engine": {"backend": "scripted", "scripted": {"tokens_per_second": 60, "answer_text": "x " * 30}},
        "store": {"backend": "sqlite", "sqlite_path": str(tmp_path / "drain.db")},
        "safety": {"enabled": False},
        "connection": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.05}, "graceful_shutdown_timeout_s": 60},
        "render": {"ray_actor_options": {"num_cpus": 0.05}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.05}},
        "cache": {"max_entries": 64 + generation},  # a changed argument: Serve rolls every replica
    }


async def agent(url: str, n: int) -> dict:
    """Runs turns until the server closes the socket; then reconnects and continues the chain."""
    log = {"completed": [], "created_without_terminal": [], "close_code": None, "close_error": None}
    prev = None
    async with connect(ws_url(url), open_timeout=30, close_timeout=5,
                       additional_headers={"x-session-id": f"drain-agent-{n}"}) as ws:
        try:
            while True:
                body = {"type": "response.create", "model": "loopserve-tiny", "store": True,
                        "input": f"agent {n} turn {len(log['completed'])}"}
                if prev:
                    body["previous_response_id"] = prev
                await ws.send(json.dumps(body))
                created = None
                while True:
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    log.setdefault("last", []).append(ev["type"])
                    del log["last"][:-4]
                    if ev["type"] == "response.created":
                        created = ev["response"]["id"]
                    elif ev["type"] in TERMINAL:
                        assert ev["response"]["id"] == created
                        assert ev["type"] == "response.completed", ev
                        log["completed"].append(created)
                        prev = created
                        break
                    elif ev["type"] == "error":
                        log["close_error"] = ev["error"]["code"]
                        if created:
                            log["created_without_terminal"].append(created)
                        break
                if log["close_error"]:
                    await asyncio.wait_for(ws.recv(), 30)  # the close follows the error
        except ConnectionClosed as closed:
            # Closed while sending the next create: read what arrived before the close.
            try:
                while True:
                    ev = json.loads(await ws.recv())
                    if ev["type"] == "error":
                        log["close_error"] = ev["error"]["code"]
            except ConnectionClosed:
                pass
            log["close_code"] = closed.rcvd.code if closed.rcvd else None
            log["close_reason"] = closed.rcvd.reason if closed.rcvd else None
    # Reconnect (like a client: retry a 503 from a replica still draining) and
    # continue the chain from the store.
    for attempt in range(10):
        try:
            async with connect(ws_url(url), open_timeout=60,
                               close_timeout=5) as ws:
                await ws.send(json.dumps({"type": "response.create", "model": "loopserve-tiny", "store": True,
                                          "previous_response_id": prev, "input": "after reconnect"}))
                while True:
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    if ev["type"] in TERMINAL or ev["type"] == "error":
                        break
                if ev["type"] == "error" and ev["error"]["code"] == "websocket_connection_limit_reached":
                    # It reached a replica as that one began draining: reconnect, as Codex does.
                    log["told_to_reconnect_again"] = log.get("told_to_reconnect_again", 0) + 1
                    continue
                log["after_reconnect"] = ev
                return log
        except InvalidStatus as refused:
            assert refused.response.status_code == 503
            log["refused_while_draining"] = log.get("refused_while_draining", 0) + 1
            await asyncio.sleep(1)
    raise AssertionError(f"could not reconnect: {log}")


async def test_rolling_redeploy_drains_sockets_cleanly(serve_instance, tmp_path):
    from tests.support.local_cluster import deploy

    url = await asyncio.to_thread(deploy_app, "drain", "/drain", drain_args(tmp_path, 0), serve_instance, 240)
    try:
        agents = [asyncio.create_task(agent(url, n)) for n in range(6)]
        await asyncio.sleep(3)  # every agent is mid-loop
        await asyncio.to_thread(deploy, serve_instance, "drain", "/drain", drain_args(tmp_path, 1), 240)
        logs = await asyncio.wait_for(asyncio.gather(*agents), 300)
    finally:
        delete_in_background("drain")
    for log in logs:
        log = {**log, "completed": len(log["completed"])} | {"completed_ids": log["completed"]}
        brief = {k: v for k, v in log.items() if k != "completed_ids"}
        # Told to reconnect, and closed 1001 (going away), never cut mid-turn.
        assert log["close_error"] == "websocket_connection_limit_reached", brief
        assert log["close_code"] == 1001, brief
        assert log["created_without_terminal"] == [], brief
        assert log["completed"] >= 2
        # The chain continues on the new replicas (loaded from the store).
        assert log["after_reconnect"]["type"] == "response.completed", log["after_reconnect"]
        assert log["after_reconnect"]["response"]["previous_response_id"] == log["completed_ids"][-1]
