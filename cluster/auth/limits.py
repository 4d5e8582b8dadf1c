"""A key's limits held across every connection replica, not per replica.

Each replica admits against its own windows (`cluster/auth/keys.py`: a sliding minute per key, the
sockets it holds), synchronously, on the path of every request. Alone, that makes a key's limits
multiply with the replicas HAProxy spreads it over. So every replica reports what
it holds, per window, to one ledger (the `LimitsAndVerdicts` deployment) about once a second, and
gets back what the other replicas hold; its admission counts both. The price of admitting
without a hop: a key can overshoot by what the other replicas admitted in the last report
interval (at 600 a minute, ~10 a second of them). A replica whose reports stop (it died, or was
scaled away) drops out of the others' counts after STALE_S; a ledger that cannot be reached
leaves each replica with its own limits after STALE_S (open, with a warning), never closed.

`LimitLedger` is the ledger's state; `LimitReports` is the replica's side. Both are plain
objects driven by the caller's clock: the deployment and the timer are in `actors/limits.py`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Optional

log = logging.getLogger("loopserve.limits")

REPORT_S = 1.0  # how often a replica reports what it holds
STALE_S = 10.0  # a report older than this no longer counts (its replica is gone, or the ledger is)
MAX_WINDOWS = 100_000  # windows one report may carry: keys x 3, far above any key file


class LimitLedger:
    """What every connection replica holds, per window (a key's creates, reads or sockets)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, int]]] = {}

    def report(self, replica: str, held: dict[str, int], now: float) -> dict[str, int]:
        """Record `replica`'s counts; return the sums of every other live replica's."""
        if len(held) > MAX_WINDOWS:
            raise ValueError(f"a report of {len(held)} windows (at most {MAX_WINDOWS})")
        if held:
            self._reports[replica] = (now, held)
        else:
            self._reports.pop(replica, None)  # holds nothing: no entry to keep
        others: dict[str, int] = defaultdict(int)
        for name, (at, counts) in list(self._reports.items()):
            if now - at > STALE_S:
                del self._reports[name]
            elif name != replica:
                for window, n in counts.items():
                    others[window] += n
        return dict(others)

    @property
    def replicas(self) -> int:
        return len(self._reports)


class LimitReports:
    """A replica's side: what the other replicas hold, as of their last report, and until when it counts."""

    def __init__(self) -> None:
        self.elsewhere: dict[str, int] = {}
        self._heard_at: Optional[float] = None
        self._warned = False

    def heard(self, others: dict[str, int], now: float) -> None:
        self.elsewhere, self._heard_at, self._warned = others, now, False

    def unheard(self, now: float, error: BaseException) -> None:
        """A report failed: the last counts hold until they are STALE_S old, then this replica
        admits on its own windows alone (its limits are then per replica again)."""
        if self._heard_at is not None and now - self._heard_at <= STALE_S:
            return
        if self.elsewhere or not self._warned:
            log.warning("the limits ledger has not answered for %.0f s (%s): this replica enforces its keys' "
                        "limits on its own until it does", STALE_S, error)
            self._warned = True
        self.elsewhere = {}

    def count(self, window: str) -> int:
        return self.elsewhere.get(window, 0)
