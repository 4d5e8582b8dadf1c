"""A key's rate limit holds for the whole app, not per connection replica: two
connection replicas behind the proxy, requests spread over both by their session ids, and the
key's creates a minute are what its limit says, with the LimitsAndVerdicts summing the replicas."""

import time

import httpx
import pytest

from tests.support.apps import module_app, scripted_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
KEY = "sk-shared-limit-0001"
LIMIT = 12


@pytest.fixture(scope="module")
def shared_url(serve_instance):
    from cluster.auth import key_sha256

    args = scripted_app(connection={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.05}},
                        auth={"keys": [{"sha256": key_sha256(KEY), "tenant": "t", "requests_per_minute": LIMIT}]})
    yield from module_app("shared-limits", "/shared", args, serve_instance, 180)


def test_a_keys_creates_a_minute_hold_across_two_connection_replicas(shared_url):
    def create(i: int) -> int:
        r = httpx.post(shared_url + "/v1/responses", timeout=60,
                       headers={"authorization": f"Bearer {KEY}", "x-session-id": f"spread-{i}"},
                       json={"model": "loopserve-tiny", "input": "hi", "max_output_tokens": 4})
        assert r.status_code in (200, 429), r.text
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in r.headers
        return r.status_code

    first = [create(i) for i in range(LIMIT // 2)]
    assert first == [200] * (LIMIT // 2)
    time.sleep(3)  # the replicas' reports (one a second) reach the ledger and come back
    rest = []
    for i in range(LIMIT // 2, LIMIT * 3):
        rest.append(create(i))
        time.sleep(0.5)
    # Per replica, each would admit LIMIT: ~2 x LIMIT of these 36 in all. Shared: LIMIT, and what
    # the other replica admitted since its last report (one a second; these come two a second).
    admitted = first.count(200) + rest.count(200)
    assert LIMIT <= admitted <= LIMIT + 4, (first, rest)
