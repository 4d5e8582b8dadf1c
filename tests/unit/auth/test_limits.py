"""A key's limits held across connection replicas (they multiplied with the
replicas): two replicas' Authenticators and one ledger, driven by one clock, no Ray."""

import pytest

from cluster.auth import Authenticator, Principal
from cluster.config import AuthConfig, LoopserveConfig
from cluster.protocol.errors import ApiError
from cluster.auth.limits import STALE_S, LimitLedger

KEY = Principal("t", "key1", max_connections=3, requests_per_minute=10, reads_per_minute=100)


def exchange(ledger: LimitLedger, replicas: dict[str, Authenticator], now: float) -> None:
    """A round of reports from every replica (as their LimitReporters make them each second),
    then what each hears back once all are in."""
    for name, auth in replicas.items():
        ledger.report(name, auth.held(now), now)
    for name, auth in replicas.items():
        auth.shared.heard(ledger.report(name, auth.held(now), now), now)


def admitted(auth: Authenticator, n: int, now: float) -> int:
    ok = 0
    for _ in range(n):
        try:
            auth.admit_request(KEY, now=now)
            ok += 1
        except ApiError as err:
            assert err.status == 429 and err.retry_after_s is not None
    return ok


def test_a_keys_creates_are_limited_across_replicas_not_per_replica():
    ledger = LimitLedger()
    a, b = Authenticator(AuthConfig()), Authenticator(AuthConfig())
    replicas = {"a": a, "b": b}
    assert admitted(a, 6, now=100.0) == 6
    exchange(ledger, replicas, now=100.5)
    assert b.shared.count("key1") == 6
    assert admitted(b, 10, now=101.0) == 4  # 10 a minute for the key, not 10 per replica
    exchange(ledger, replicas, now=101.5)
    assert admitted(a, 5, now=102.0) == 0
    exchange(ledger, replicas, now=160.5)  # a's 6 (at 100 s) have slid out of the minute, b's 4 not yet
    assert admitted(a, 10, now=160.6) == 6


def test_a_keys_sockets_are_counted_across_replicas():
    ledger = LimitLedger()
    a, b = Authenticator(AuthConfig()), Authenticator(AuthConfig())
    a.open_connection(KEY)
    a.open_connection(KEY)
    exchange(ledger, {"a": a, "b": b}, now=1.0)
    b.open_connection(KEY)
    with pytest.raises(ApiError) as err:
        b.open_connection(KEY)
    assert err.value.status == 429
    a.close_connection(KEY)
    exchange(ledger, {"a": a, "b": b}, now=2.0)
    b.open_connection(KEY)


def test_a_replica_that_stops_reporting_drops_out_and_a_silent_ledger_leaves_limits_per_replica():
    ledger = LimitLedger()
    a, b = Authenticator(AuthConfig()), Authenticator(AuthConfig())
    admitted(a, 10, now=100.0)
    exchange(ledger, {"a": a, "b": b}, now=100.0)
    assert admitted(b, 1, now=100.0) == 0
    # a is gone (its node died): after STALE_S its counts no longer hold b back
    assert ledger.report("b", b.held(100.0 + STALE_S + 1), now=100.0 + STALE_S + 1) == {}
    # the ledger unreachable: the last counts hold for STALE_S, then b is on its own
    b.shared.heard({"key1": 10}, now=200.0)
    b.shared.unheard(200.0 + STALE_S - 1, TimeoutError())
    assert b.shared.count("key1") == 10
    b.shared.unheard(200.0 + STALE_S + 1, TimeoutError())
    assert b.shared.count("key1") == 0 and admitted(b, 10, now=201.0) == 10


def test_reports_hold_only_the_windows_in_use():
    auth = Authenticator(AuthConfig())
    auth.admit_request(KEY, now=1.0)
    auth.admit_read(KEY, now=1.0)
    assert auth.held(2.0) == {"key1": 1, "key1/read": 1}
    assert auth.held(62.0) == {}  # slid out: nothing to report, nothing kept
    with pytest.raises(ValueError):
        LimitLedger().report("x", {str(i): 1 for i in range(100_001)}, now=0.0)


@pytest.mark.parametrize("connection,shared", [
    ({}, False), ({"num_replicas": 2}, True), ({"num_replicas": "auto"}, True),
    ({"autoscaling_config": {"max_replicas": 1}}, False), ({"autoscaling_config": {}}, True),
])
def test_limits_are_shared_when_the_connection_deployment_can_have_several_replicas(connection, shared):
    assert LoopserveConfig.model_validate({"connection": connection}).shares_limits is shared
    forced = LoopserveConfig.model_validate({"connection": connection, "limits": {"shared_across_replicas": True}})
    assert forced.shares_limits
