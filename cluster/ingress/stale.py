"""Before `loopserve serve` starts Ray: who holds the ports it is about to take?

An HAProxy left behind by an earlier loopserve (killed before `loopserve-haproxy` tied HAProxy
to its proxy, or started without it) keeps the HTTP port and the stats port; Serve's proxy then
dies with HAProxy's "cannot bind socket" and nothing answers. Such an HAProxy is recognised by
what it is: an `haproxy` whose parent is gone (re-parented to init or a subreaper) and whose
config is one Serve wrote (`.../haproxy-serve/...`). It is stopped, and so is an orphaned Ray worker
(`ray::...`) still holding a port after its cluster was killed (a replica's listener can sit on any
free port, the HTTP port of the next start included, until the worker notices its raylet is gone).
Anything else on the ports is named, with its pid, and the start is refused. Linux /proc only;
elsewhere nothing is checked.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

SERVE_HAPROXY_MARK = "haproxy-serve"


@dataclass(frozen=True)
class PortHolder:
    pid: int
    name: str
    cmdline: str
    ppid: int
    port: int

    @property
    def orphaned(self) -> bool:
        return self.ppid == 1 or not _alive(self.ppid) or _name(self.ppid) in ("systemd", "init", "tini")

    @property
    def serve_haproxy(self) -> bool:
        return self.name == "haproxy" and SERVE_HAPROXY_MARK in self.cmdline

    @property
    def ray_worker(self) -> bool:
        # Ray names its worker processes `ray::<actor>` (a Serve replica: `ray::ServeReplica:...`).
        return self.name.startswith("ray::")

    @property
    def stale_serve_haproxy(self) -> bool:
        return self.serve_haproxy and self.orphaned

    @property
    def stale(self) -> bool:
        """Left by a Ray cluster that is gone: its HAProxy, or one of its workers (a replica's
        listener) whose raylet died with a SIGKILL of the group and which has not exited yet."""
        return (self.serve_haproxy or self.ray_worker) and self.orphaned


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _name(pid: int) -> str:
    return _read(f"/proc/{pid}/comm").strip()


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (TCP, v4 and v6, any address)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _read(table).splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def holders(ports: Iterable[int]) -> list[PortHolder]:
    wanted = {inode: port for port in ports for inode in listening_inodes(port)}
    if not wanted:
        return []
    found: dict[tuple[int, int], PortHolder] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[8:-1] if target.startswith("socket:[") else None
            if inode in wanted and (pid, wanted[inode]) not in found:
                stat = _read(f"/proc/{pid}/stat")
                ppid = int(stat.rsplit(")", 1)[1].split()[1]) if ")" in stat else 0
                cmdline = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
                found[(pid, wanted[inode])] = PortHolder(pid, _name(pid), cmdline, ppid, wanted[inode])
    return list(found.values())


def clear_ports(ports: Iterable[int], *, wait_s: float = 15.0) -> Optional[str]:
    """Stop stale Serve HAProxies on `ports`; wait out one whose Ray proxy is still dying (a
    restart right after a kill: `loopserve-haproxy` stops it once its proxy is gone). Returns
    why the start must be refused, or None."""
    if not os.path.isdir("/proc/net"):
        return None
    ports = list(ports)
    signalled: set[int] = set()
    deadline = time.monotonic() + wait_s
    while True:
        left = holders(ports)
        if not left:
            return None
        for holder in left:
            if not (holder.serve_haproxy or holder.ray_worker):
                return (f"port {holder.port} is in use by pid {holder.pid} ({holder.name}: {holder.cmdline[:120]}); "
                        "stop it or choose another --port")
            if holder.stale and holder.pid not in signalled:
                print(f"loopserve: stopping {holder.name} pid {holder.pid} left on port {holder.port} by an earlier "
                      "loopserve that did not stop cleanly", flush=True)
                signalled.add(holder.pid)
                try:
                    os.kill(holder.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            h = left[0]
            return (f"port {h.port} is held by {h.name} pid {h.pid} of a Ray Serve cluster that is still running "
                    f"(its parent, pid {h.ppid}, is alive); stop that cluster (`ray stop`) or choose another --port")
        time.sleep(0.2)
