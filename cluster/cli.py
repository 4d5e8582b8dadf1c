"""`loopserve` command: serve the app, or generate the tiny model."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import yaml

from cluster.models.names import BUILTIN_NAMES

if TYPE_CHECKING:
    from cluster.config import LoopserveConfig


class ConfigUnusable(Exception):
    """A config file `loopserve serve` cannot use, and why (the file named)."""


def load_config(config_path: Optional[str]) -> LoopserveConfig:
    """The config of the (single) application in a Serve config file (no file: the defaults)."""
    from pydantic import ValidationError

    from cluster.config import LoopserveConfig

    data: object = {}
    if config_path:
        try:
            data = yaml.safe_load(Path(config_path).read_text())
        except OSError as exc:
            raise ConfigUnusable(f"cannot read {config_path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigUnusable(f"{config_path} is not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigUnusable(f"{config_path} holds no mapping (a Serve config file, or loopserve's args)")
    apps = data.get("applications") or []
    args = (apps[0].get("args") if apps and isinstance(apps[0], dict) else data.get("args")) or {}
    try:
        return LoopserveConfig.model_validate(args)
    except ValidationError as exc:
        raise ConfigUnusable(f"{config_path or 'the default config'}: {exc}") from None


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def local_cluster_security(environ: Optional[dict] = None) -> None:
    """The single-host cluster `loopserve serve` starts is closed to callers without its token. Ray's
    processes and every Serve replica listen on TCP beyond loopback (Ray binds replicas' gRPC servers
    on every interface and never takes 127.0.0.1 as a node's address), and a replica unpickles what
    its gRPC server is sent: so Ray's token auth is on (RAY_AUTH_MODE=token; Ray keeps a generated
    token in ~/.ray/auth_token, shared by the processes it starts), and an operator's
    `RAY_AUTH_MODE=disabled` is refused rather than run open. Set before Ray is imported: it reads
    the mode once per process."""
    environ = os.environ if environ is None else environ
    mode = environ.get("RAY_AUTH_MODE", "").lower()
    if mode and mode != "token":
        raise ConfigUnusable(f"RAY_AUTH_MODE={mode}: a cluster without Ray's token auth runs code for anyone who "
                             "can reach its ports (a Serve replica unpickles what its gRPC server is sent). Unset "
                             "it (loopserve serve turns token auth on), or set RAY_AUTH_MODE=token")
    environ["RAY_AUTH_MODE"] = "token"


def _ports(http_port: int) -> list[int]:
    """The ports the cluster this command starts takes on this machine (HAProxy's stats page too)."""
    from cluster.ingress.modes import haproxy_ingress

    stats = int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404"))
    return [http_port, stats] if haproxy_ingress() else [http_port]


def cmd_serve(ns: argparse.Namespace) -> int:
    if not ns.address:
        try:
            local_cluster_security()
        except ConfigUnusable as exc:
            print(f"loopserve serve: {exc}", file=sys.stderr)
            return 2
    import ray
    from ray import serve

    from cluster.app import DeployFailed, run_app
    from cluster.config import KeysMissing
    from cluster.ingress.modes import apply_ingress_env, haproxy_ingress
    from cluster.ingress.stale import clear_ports

    try:
        config = load_config(ns.config)
    except ConfigUnusable as exc:
        print(f"loopserve serve: {exc}", file=sys.stderr)
        return 2
    if ns.backend:
        config.engine.backend = ns.backend
    if ns.keys_file:
        config.auth.keys_file = ns.keys_file
    if not _loopback(ns.host):
        # Reachable from other machines: API keys or no start (with keys, every request names
        # its tenant and is held to that key's limits).
        config.auth.require_keys = True
        try:
            config.auth.resolved()
        except KeysMissing as exc:
            print(f"loopserve serve: --host {ns.host} accepts connections from other machines, so API keys "
                  f"are required: {exc}; or bind --host 127.0.0.1", file=sys.stderr)
            return 2
    if not ns.address:
        if _loopback(ns.host):  # one machine: its engine channels stay on loopback
            for engine in (config.engine, config.safety.guard.engine):
                engine.channel_host = engine.channel_host or "127.0.0.1"
        apply_ingress_env(ns.ingress)  # before Ray starts: Serve reads it once, cluster-wide
        refused = clear_ports(_ports(ns.port))
        if refused:
            print(f"loopserve serve: {refused}", file=sys.stderr)
            return 2
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True

    if ns.address:
        ray.init(address=ns.address)
    else:
        ray.init(num_cpus=ns.num_cpus, include_dashboard=False)
    # Right after ray.init (which installs its own SIGTERM handler): a signal while the app
    # deploys (HAProxy may already answer) still gets the clean stop below, never Ray's abort.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    serve.start(http_options={"host": ns.host, "port": ns.port})
    try:
        run_app(config, "loopserve", "/")
    except DeployFailed as exc:
        logs = "the Serve logs on the cluster's nodes" if ns.address else "/tmp/ray/session_latest/logs/serve/"
        print("loopserve serve: the app did not start:\n  " + "\n  ".join(exc.summary()) +
              f"\n(each replica's whole error: {logs})", file=sys.stderr, flush=True)
        serve.delete("loopserve")
        serve.shutdown()
        ray.shutdown()
        return 1
    ingress = "HAProxy" if haproxy_ingress() else "Serve's proxy"
    print(f"loopserve: serving {config.model.name} ({config.engine.backend}) on http://{ns.host}:{ns.port}/v1 "
          f"({ingress})", flush=True)
    while not stop["now"]:
        time.sleep(0.2)
    # The app first, while HAProxy still relays: each replica drains (turns in flight finish,
    # bounded by graceful_shutdown_timeout_s; WebSockets then close with 1001 for reconnection).
    # `serve.shutdown()` alone stops the proxies at the same time and cuts every socket mid-turn.
    print("loopserve: stopping (turns in flight finish first)", flush=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C stops without waiting
    serve.delete("loopserve")
    serve.shutdown()
    ray.shutdown()
    return 0


def cmd_make_model(ns: argparse.Namespace) -> int:
    from cluster.models.builtin import ModelUnavailable, ensure_builtin

    unknown = [name for name in ns.models if name not in BUILTIN_NAMES]
    if unknown:
        print(f"loopserve make-model: unknown model {unknown[0]!r}; choose from {', '.join(BUILTIN_NAMES)}",
              file=sys.stderr)
        return 2
    try:
        for name in ns.models or BUILTIN_NAMES:
            print(ensure_builtin(name), flush=True)
    except ModelUnavailable as exc:
        print(f"loopserve make-model: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_bench(argv: list[str]) -> int:
    from cluster.bench.commands import main as bench_main

    return bench_main(argv)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="loopserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start a local Ray cluster and serve the Responses API")
    s.add_argument("--config", default=None, help="a Serve config file (its first application's args are used)")
    s.add_argument("--backend", choices=["vllm", "scripted"], default=None)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--keys-file", default=None,
                   help="a YAML file of API key digests (auth.keys_file); required to bind beyond loopback "
                        "unless the config holds keys")
    s.add_argument("--address", default=None, help="join an existing Ray cluster instead of starting one")
    s.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    s.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                   help="HAProxy in front of the connection replicas (default), or Serve's Python proxy; "
                        "applies to the Ray cluster this command starts (see cluster/ingress/modes.py)")
    s.set_defaults(fn=cmd_serve)
    # A benchmark's own parser reads what follows its name (cluster/bench/commands.py).
    b = sub.add_parser("bench", help="the benchmarks, one subcommand each (`loopserve bench --help`)", add_help=False)
    b.set_defaults(fn=cmd_bench)
    m = sub.add_parser("make-model", help="make the built-in models ahead of their first start (no download)")
    # Checked by hand: Python 3.11.7's argparse rejects an empty `nargs="*"` list against `choices`.
    m.add_argument("models", nargs="*", metavar="MODEL",
                   help=f"one of {', '.join(BUILTIN_NAMES)} (default: all of them)")
    m.set_defaults(fn=cmd_make_model)
    ns, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ns.fn is cmd_bench:
        return cmd_bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return ns.fn(ns)


if __name__ == "__main__":
    sys.exit(main())
