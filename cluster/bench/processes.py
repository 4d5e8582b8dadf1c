"""The processes of a local run, read from /proc: which are Serve replicas, how much memory they
hold, and how much CPU each kind of process spent over a phase of a benchmark.

CPU is where a 2-core machine's latency goes: a benchmark that reports only the client's clock
cannot tell the server's work from its own clients'. `CpuMeter` snapshots every process's
user+system time at the start and end of a phase and groups the difference by what the process
is (a replica by deployment, HAProxy, Ray's own daemons, the bench's clients), so a report can
say "the connection replica spent N ms of CPU a turn" beside the turn's wall time.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

TICKS = os.sysconf("SC_CLK_TCK")


def _title(pid: str) -> str:
    try:
        return (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def replicas() -> dict[str, tuple[int, str]]:
    """Live Serve replica processes on this machine: key -> (pid, deployment), from their process
    titles (`ray::ServeReplica:<app>:<deployment>`, `.<method>` appended while Ray runs a call of
    it: not a new replica); a restarted replica is a new pid."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            title = _title(entry.name)
            named = replica_of(title)
            if named is not None:
                out[f"{named[0]}:{named[1]}#{entry.name}"] = (int(entry.name), named[1])
    return out


def replica_of(title: str) -> Optional[tuple[str, str]]:
    """(app, deployment) of a Serve replica's process title, or None for any other process."""
    if not title.startswith("ray::ServeReplica:"):
        return None
    app, deployment = title.split(":")[-2:]
    return app, deployment.strip().split(".")[0]


def rss(pid: int, field: str = "VmHWM") -> int:
    """A process's resident memory from /proc: its peak (VmHWM) or now (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has spent, in seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15 of stat)


def kind_of(title: str) -> Optional[str]:
    """What a process is, for grouping its CPU: a Serve replica by deployment, HAProxy, Ray's own
    processes; None for a process that is not part of the run."""
    if title.startswith("ray::ServeReplica:"):
        return title.split(":")[-1].split(".")[0].strip()  # "EngineReplica.handle_request..." while it runs one
    base = os.path.basename(title.split(" ")[0])
    if base == "haproxy":
        return "haproxy"
    if title.startswith("ray::") or base in ("raylet", "gcs_server") or "ray/" in title:
        return "ray (controller, proxy, daemons)"
    return None


class CpuMeter:
    """CPU seconds per kind of process over one phase: `start()`, run the phase, `stop()`.
    `extra` names processes the titles do not (the bench's own client processes)."""

    def __init__(self, extra: Optional[Callable[[], dict[int, str]]] = None) -> None:
        self.extra = extra or (lambda: {})
        self._start: dict[int, tuple[str, float]] = {}

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        named = self.extra()
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            kind = named.get(pid) or kind_of(_title(entry.name))
            if kind:
                out[pid] = (kind, cpu_seconds(pid))
        return out

    def start(self) -> None:
        self._start = self._snapshot()

    def stop(self) -> dict[str, float]:
        """CPU seconds each kind spent since `start()`; a process started in between counts whole."""
        spent: dict[str, float] = defaultdict(float)
        for pid, (kind, now) in self._snapshot().items():
            before = self._start.get(pid)
            spent[kind] += now - (before[1] if before else 0.0)  # a title can change (a replica's names its method)
        return {k: round(v, 2) for k, v in sorted(spent.items())}
