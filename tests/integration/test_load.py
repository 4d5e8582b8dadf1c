"""1,000 concurrent WebSocket sessions x 10 turns on the scripted engine: nothing lost or leaked."""

import pytest

from cluster.bench.load import LOAD_APP, print_load, run_load
from tests.support.apps import deploy_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


async def test_thousand_sessions_by_ten_turns(serve_instance):
    import asyncio

    from ray import serve

    url = await asyncio.to_thread(deploy_app, "load", "/load", LOAD_APP, serve_instance, 240)
    try:
        report = await asyncio.wait_for(run_load(url, 1000, 10), 600)
    finally:
        await asyncio.to_thread(serve.delete, "load")
    print_load(report)
    assert report["problems"] == {}  # no lost, duplicated or foreign events, no errors
    assert report["turns_completed"] == 10_000
    assert report["idle_sockets"] >= 1000
    # Idle sessions cost what their caches hold plus the socket itself, nowhere near the cache limits.
    assert report["cache_bytes_per_idle_session"] < 64 * 1024
    assert report["rss_per_idle_session_bytes"] < 1024 * 1024
