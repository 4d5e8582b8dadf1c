"""The apps the integration tests deploy: their settings, and deploying one (for the session,
or for one module: deleted after it, so the session's apps never all hold memory at once)."""

from __future__ import annotations

import threading
import time
from typing import Any

from cluster.config import LoopserveConfig

# A prompt holding LONG_ONE gets a long answer (a response still running when cancelled).
LONG_ONE = "long one"
LONG_RULE = {"contains": LONG_ONE, "text": "word " * 400}
SCRIPTED_ANSWER = (
    "I looked at the files you asked about and the change is done; the tests pass and nothing else "
    "needs to be edited in this repository right now."
)

# Scripted apps take small CPU shares: many of them share the test session's 4-CPU cluster.
SMALL = {"connection": {"ray_actor_options": {"num_cpus": 0.05}}, "render": {"ray_actor_options": {"num_cpus": 0.05}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.05}}}


def scripted_app(scripted: dict[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    """The args of an app on the scripted engine (the named stand-in for a GPU engine), with no
    store and small CPU shares, then `sections` (a dict section is merged into the default one).
    Validated here: a typo fails in the test that made it, not in a replica."""
    args: dict[str, Any] = {"engine": {"backend": "scripted", **({"scripted": scripted} if scripted else {})},
                            "store": {"backend": "none"}, **SMALL}
    for name, value in sections.items():
        base = args.get(name)
        args[name] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    LoopserveConfig.model_validate(args)
    return args


def deploy_app(name: str, prefix: str, args: dict, base: str, timeout: float, admin: bool = True) -> str:
    from tests.support.local_cluster import deploy

    return deploy(base, name, prefix, args, timeout, admin=admin)


def module_app(name: str, prefix: str, args: dict, base: str, timeout: float, admin: bool = True):
    """An app one test module uses: deleted after it, so the session's apps never all hold
    memory at once (with every app alive, Ray's memory monitor killed the Serve controller).
    The deletion runs beside the next module (`delete_in_background`): stopping an app's replicas
    takes seconds (a vLLM engine's ~6 s) that no test needs to wait for."""
    url = deploy_app(name, prefix, args, base, timeout, admin)
    try:
        yield url
    finally:
        delete_in_background(name)


_deleting: list[threading.Thread] = []


def delete_in_background(name: str) -> None:
    """`serve.delete(name)` on a thread of its own; `wait_for_deletions` joins them. Every app has
    its own name and route prefix, so nothing the next module deploys meets the one going away."""

    def delete() -> None:
        from ray import serve

        try:
            serve.delete(name)
        except Exception:  # noqa: BLE001 - the cluster may be going down with the session
            pass

    thread = threading.Thread(target=delete, name=f"delete-{name}", daemon=True)
    thread.start()
    _deleting.append(thread)


def wait_for_deletions(timeout: float = 60) -> None:
    """Before the cluster stops: the apps still being deleted are gone (bounded)."""
    deadline = time.monotonic() + timeout
    while _deleting:
        _deleting.pop().join(max(0.0, deadline - time.monotonic()))


SMOLLM2 = "smollm2-135m-instruct"
GUARD_UNSAFE, GUARD_GARBLED = "hateful-marker-7731", "garbled-marker-4419"
KEY_A, KEY_B, KEY_LIMITED = "sk-tenant-a-0001", "sk-tenant-b-0002", "sk-limited-0003"
KEY_READER = "sk-reader-0004"  # reads 2 KiB a minute
KEY_WRITER = "sk-writer-0005"  # sends 4 KiB of creates a minute
PG_DATABASE = "loopserve_test"
ALLOWED_ORIGIN = "https://app.example"


def ensure_pg_database() -> str:
    import asyncio

    import asyncpg

    async def create():
        conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PG_DATABASE):
                await conn.execute(f"CREATE DATABASE {PG_DATABASE}")
        finally:
            await conn.close()

    # (callable from async tests too: run on a thread with its own loop)
    import threading

    t = threading.Thread(target=lambda: asyncio.run(create()))
    t.start()
    t.join(30)
    return f"postgresql://postgres@127.0.0.1:5432/{PG_DATABASE}"


def pg_app_args() -> dict:
    from cluster.auth import key_sha256

    return {
        "engine": {"backend": "scripted", "scripted": {"tokens_per_second": 200, "max_output_tokens": 256,
                                                       "answer_rules": [LONG_RULE]}},
        "store": {"backend": "postgres", "postgres_dsn": ensure_pg_database()},
        "auth": {"keys": [
            {"sha256": key_sha256(KEY_A), "tenant": "tenant-a"},
            {"sha256": key_sha256(KEY_B), "tenant": "tenant-b"},
            {"sha256": key_sha256(KEY_LIMITED), "tenant": "tenant-c", "max_connections": 1,
             "requests_per_minute": 3, "reads_per_minute": 4},
            {"sha256": key_sha256(KEY_READER), "tenant": "tenant-d", "read_bytes_per_minute": 2048},
            {"sha256": key_sha256(KEY_WRITER), "tenant": "tenant-e", "input_bytes_per_minute": 4096},
        ]},
        "connection": {"ray_actor_options": {"num_cpus": 0.05}}, "render": {"ray_actor_options": {"num_cpus": 0.05}}, "engine_deployment": {"ray_actor_options": {"num_cpus": 0.05}},
        "safety": {"deployment": {"ray_actor_options": {"num_cpus": 0.05}}, "policy": {"secrets": ["BEGIN RSA PRIVATE KEY"]}},
        "websocket": {"allowed_origins": [ALLOWED_ORIGIN]},
    }


# What the scripted engine answers Codex (a named fake model: rules on the prompt's text).
# A task asks for a marker file; the engine calls Codex's exec_command tool, and answers once
# the command's output (only there: the command computes it) is in the prompt.
CODEX_MARK, CODEX_SECOND = "LOOPSERVE_MARK_42", "LOOPSERVE_SECOND_7"


def _exec_call(cmd: str) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": "exec_command", "arguments": {"cmd": cmd}}) + "\n</tool_call>"


# Compaction: Codex with a provider of its own compacts locally, with one request that carries its
# checkpoint prompt; the scripted summary then stands for the history, and the task goes on from it.
CODEX_COMPACT_PROMPT = "CONTEXT CHECKPOINT COMPACTION"  # in Codex 0.171's compaction prompt
CODEX_SUMMARY, CODEX_LISTED = "LOOPSERVE_SUMMARY_3", "LOOPSERVE_LIST_9"

CODEX_RULES = [
    {"contains": CODEX_COMPACT_PROMPT, "text": f"{CODEX_SUMMARY}: the numbers were listed; marker {CODEX_LISTED}."},
    {"contains": CODEX_SUMMARY, "text": f"Resumed from the summary: the marker was {CODEX_LISTED}."},
    {"contains": CODEX_LISTED, "text": _exec_call("echo LOOPSERVE_AFTER_$((2+3))")},
    {"contains": "list the numbers", "text": _exec_call("seq 1 3000; echo LOOPSERVE_LIST_$((4+5))")},
    {"contains": "Say hi", "text": "Hi."},
    {"contains": CODEX_SECOND, "text": "The file still holds the marker. All done."},
    {"contains": "now read it back", "text": _exec_call("cat marker.txt; echo LOOPSERVE_SECOND_$((3+4))")},
    {"contains": CODEX_MARK, "text": "I wrote the marker file. Done."},
    {"contains": "write the marker", "text": _exec_call("echo LOOPSERVE_MARK_$((6*7)) > marker.txt && cat marker.txt")},
]
