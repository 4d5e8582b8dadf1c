"""What every connection replica shares: keys' limits (`cluster/auth/limits.py` says how)
and verdicts on the chat template's delta renders (`cluster/core/render/audit.py`).

`LimitsAndVerdicts` is one small replica per app that sums what the connection replicas report;
`LimitReporter` is the timer in each connection replica that reports and takes the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Optional

from ray import serve

from cluster.auth import Authenticator
from cluster.core.render.audit import TemplateVerdicts
from cluster.auth.limits import REPORT_S, LimitLedger

log = logging.getLogger("loopserve.limits")


@serve.deployment(name="LimitsAndVerdicts", num_replicas=1, max_ongoing_requests=1024,
                  ray_actor_options={"num_cpus": 0})
class LimitsAndVerdicts:
    """One replica, always: two would each hold half the picture. Lost (its node died), Serve
    starts another; the connection replicas' next reports refill it within REPORT_S, and until
    then each replica keeps the counts it last heard."""

    def __init__(self) -> None:
        self.ledger = LimitLedger()
        self.verdicts = TemplateVerdicts()

    async def report(self, replica: str, held: dict[str, int]) -> dict[str, int]:
        return self.ledger.report(replica, held, time.monotonic())

    async def template_verdicts(self, found: dict[str, str]) -> dict[str, str]:
        return self.verdicts.merge(found)

    async def stats(self) -> dict[str, Any]:
        return {"replicas": self.ledger.replicas}


class LimitReporter:
    """Every REPORT_S: this replica's counts to the ledger, the other replicas' back into `auth`."""

    def __init__(self, auth: Authenticator, ledger: Any, period_s: float = REPORT_S, verdicts: Any = None) -> None:
        self.auth, self.ledger, self.period_s = auth, ledger, period_s
        self.verdicts = verdicts  # the replica's audit verdict (audit.ReplicaVerdict): reported, and the app's applied
        self.replica = uuid.uuid4().hex  # this process's name in the ledger, never reused
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="limit-reports")

    async def report_once(self) -> None:
        try:
            others = await asyncio.wait_for(self.ledger.report.remote(self.replica, self.auth.held()), self.period_s * 5)
        except Exception as exc:  # noqa: BLE001 - a ledger restarting: the last counts hold a while
            self.auth.shared.unheard(time.monotonic(), exc)
            return
        self.auth.shared.heard(others, time.monotonic())
        if self.verdicts is not None:
            try:
                found = await asyncio.wait_for(self.ledger.template_verdicts.remote(self.verdicts.report()),
                                               self.period_s * 5)
            except Exception as exc:  # noqa: BLE001 - heard on the next report
                log.debug("template verdicts not exchanged: %s", exc)
                return
            self.verdicts.apply(found)

    async def _run(self) -> None:
        while True:
            await self.report_once()
            await asyncio.sleep(self.period_s)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
