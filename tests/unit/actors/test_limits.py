"""The connection replica's reporting timer against the ledger deployment's own class (its
handle faked: a named stand-in for Serve's DeploymentHandle that awaits the real method)."""

import asyncio

from actors.limits import LimitReporter, LimitsAndVerdicts
from cluster.auth import Authenticator, Principal
from cluster.config import AuthConfig

KEY = Principal("t", "key1", max_connections=3, requests_per_minute=4, reads_per_minute=100)


class FakeLedgerHandle:
    """Stands in for the DeploymentHandle of one LimitsAndVerdicts replica (no Ray here)."""

    def __init__(self) -> None:
        self.ledger = LimitsAndVerdicts.func_or_class()
        self.down = False

        class Method:
            def remote(_, *args):
                if self.down:
                    raise ConnectionError("replica gone")
                return self.ledger.report(*args)

        class Verdicts:
            def remote(_, found):
                if self.down:
                    raise ConnectionError("replica gone")
                return self.ledger.template_verdicts(found)

        self.report = Method()
        self.template_verdicts = Verdicts()


async def test_two_replicas_share_a_keys_limit_through_the_ledger():
    handle = FakeLedgerHandle()
    a, b = Authenticator(AuthConfig()), Authenticator(AuthConfig())
    ra, rb = LimitReporter(a, handle, period_s=0.01), LimitReporter(b, handle, period_s=0.01)
    for _ in range(3):
        a.admit_request(KEY)
    await ra.report_once()
    await rb.report_once()
    b.admit_request(KEY)
    try:
        b.admit_request(KEY)
        raise AssertionError("the key's fifth create in a minute was admitted")
    except Exception as err:
        assert getattr(err, "status", None) == 429
    handle.down = True
    await rb.report_once()  # the ledger gone: the last counts still hold
    assert b.shared.count("key1") == 3
    rb.start()
    await asyncio.sleep(0.05)
    rb.stop()


async def test_a_replica_whose_audit_found_the_template_inexact_turns_the_others_off(tokenizer):
    """Two connection replicas' verdicts through the ledger's own class: the one whose audit found a
    mismatch reports it, the other renders in full from its next report on."""
    from cluster.core.render.audit import ReplicaVerdict
    from tests.support.harness import InProcessStack

    handle = FakeLedgerHandle()
    preparers = [InProcessStack(tokenizer).driver.preparer for _ in range(2)]
    verdicts = [ReplicaVerdict("{{ template }}", lambda p=p: p.deltas_off, p.render_fully) for p in preparers]
    reporters = [LimitReporter(Authenticator(AuthConfig()), handle, period_s=0.01, verdicts=v) for v in verdicts]
    for r in reporters:
        await r.report_once()
    assert all(p.deltas_off is None for p in preparers)  # nothing found: nothing changes
    preparers[0].render_fully("message 2 (tool) renders differently")
    await reporters[0].report_once()
    await reporters[1].report_once()
    assert preparers[1].deltas_off == "another connection replica: message 2 (tool) renders differently"
    turned_off: list[str] = []
    other = ReplicaVerdict("{{ another template }}", lambda: None, turned_off.append)
    other.apply(await handle.ledger.template_verdicts({}))  # a replica of another template: untouched
    assert turned_off == [] and other.report() == {}
