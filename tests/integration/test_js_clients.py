"""The JavaScript-side clients, unmodified, against a real Serve app over WebSocket mode:
Codex CLI 0.171 running a multi-turn task (the scripted engine plays the model, see
CODEX_RULES), and the openai Node SDK's ResponsesWS driving a tool loop. Both come from
npm at the versions tests/clients/package-lock.json pins."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.local_cluster import LOCAL_ADMIN_KEY
from tests.support.apps import CODEX_LISTED, CODEX_MARK, CODEX_SECOND, CODEX_SUMMARY, SCRIPTED_ANSWER

pytestmark = pytest.mark.integration


def server_stats(url: str) -> dict:
    return httpx.get(url + "/loopserve/stats", headers={"authorization": f"Bearer {LOCAL_ADMIN_KEY}"},
                     timeout=30).json()


def codex(clients: Path, home: Path, work: Path, *args: str) -> tuple[list[dict], str]:
    """`codex exec --json ...` in `work`; its JSONL events and its stderr."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "LOOPSERVE_API_KEY": "sk-test",
           # Codex logs each responsesapi.websocket_timing event it reads at trace level.
           "RUST_LOG": "warn,codex_api::responses_websocket_timing=trace"}
    proc = subprocess.run([str(clients / "node_modules" / ".bin" / "codex"), "exec", "--json", "--skip-git-repo-check",
                           "--enable", "runtime_metrics", "-s", "workspace-write", *args],
                          cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.stderr


def completed_items(events: list[dict], kind: str) -> list[dict]:
    return [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind]


def codex_config(url: str, extra: str = "") -> str:
    return f"""
model = "loopserve-tiny"
model_provider = "loopserve"
{extra}
[model_providers.loopserve]
name = "loopserve"
base_url = "{url}/v1"
wire_api = "responses"
supports_websockets = true
env_key = "LOOPSERVE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
"""


def test_codex_runs_a_multi_turn_task_over_websocket_mode(codex_url, node_clients, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(codex_config(codex_url))
    before = server_stats(codex_url)["turn_transport"]

    # Turn 1: a tool call Codex runs in its sandbox, then the answer (same socket, chained).
    events, stderr = codex(node_clients, home, work, "Please write the marker file.")
    assert "Falling back from WebSockets" not in stderr, stderr[-4000:]
    [command] = completed_items(events, "command_execution")
    assert command["exit_code"] == 0 and CODEX_MARK in command["aggregated_output"]
    assert (work / "marker.txt").read_text().strip() == CODEX_MARK
    assert [m["text"] for m in completed_items(events, "agent_message")] == ["I wrote the marker file. Done."]
    assert events[-1]["type"] == "turn.completed"
    # Codex read the server timings (x-responsesapi-include-timing-metrics) on a reused socket.
    timing_lines = [line for line in stderr.splitlines() if "responsesapi.websocket_timing" in line]
    assert len(timing_lines) >= 2 and all("engine_service_total_ms" in line for line in timing_lines)
    assert any("connection_reused=true" in line for line in timing_lines)

    # Turn 2: Codex resumes the thread on a new process (the whole history on a new socket).
    events, stderr = codex(node_clients, home, work, "resume", "--last", "Good, now read it back.")
    assert "Falling back from WebSockets" not in stderr, stderr[-4000:]
    [command] = completed_items(events, "command_execution")
    assert CODEX_MARK in command["aggregated_output"] and CODEX_SECOND in command["aggregated_output"]
    assert [m["text"] for m in completed_items(events, "agent_message")] == ["The file still holds the marker. All done."]

    stats = server_stats(codex_url)
    after = stats["turn_transport"]
    # Every response went over WebSocket mode: per run a warm-up and two sampling requests.
    assert after.get("websocket", 0) - before.get("websocket", 0) >= 6
    assert after.get("http", 0) == before.get("http", 0)
    # Each continuation rendered only its new items, the first turn after Codex's warm-up
    # (developer message after developer message) included: no fallback to a full render.
    assert stats["render_inline"]["delta_renders"] >= 4 and stats["render_inline"]["fallbacks"] == {}
    # No render replicas in this app: the first turn's and the resume's full renders ran here.
    from ray import serve

    assert "RenderActor" not in serve.status().applications["codex"].deployments
    assert stats["render_inline"]["full_renders"] >= 2 and stats["render"] == stats["render_inline"]


def test_codex_compacts_mid_task_and_continues_from_the_summary(codex_url, node_clients, tmp_path):
    """Codex's compaction round trip: past its token limit it compacts (with a provider of its own,
    locally: one request carrying its checkpoint prompt, over the same socket), replaces the
    history with the summary, and finishes the task from it, with no error."""
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(codex_config(codex_url))
    events, _ = codex(node_clients, home, work, "Say hi.")
    base = events[-1]["usage"]["input_tokens"]  # Codex's instructions and tools: every request has them
    # A limit the first request stays under and the request with the 3,000-line tool output passes.
    limit = f"model_auto_compact_token_limit = {base + 2500}"
    (home / ".codex" / "config.toml").write_text(codex_config(codex_url, limit))
    events, stderr = codex(node_clients, home, work, "Now list the numbers please.")
    assert "Falling back from WebSockets" not in stderr, stderr[-4000:]
    assert not [e for e in events if e["type"] in ("error", "turn.failed")], events
    commands = completed_items(events, "command_execution")
    assert CODEX_LISTED in commands[0]["aggregated_output"]
    messages = [m["text"] for m in completed_items(events, "agent_message")]
    assert messages[-1] == f"Resumed from the summary: the marker was {CODEX_LISTED}.", (messages, events)
    assert events[-1]["type"] == "turn.completed"
    # Codex recorded the compaction: the history was replaced by the server-written summary, the
    # 3,000-line tool output dropped, and the rest of the task ran on that.
    [compacted] = [json.loads(line)["payload"] for path in (home / ".codex" / "sessions").rglob("*.jsonl")
                   for line in path.read_text().splitlines() if '"type":"compacted"' in line]
    assert CODEX_SUMMARY in compacted["message"]
    kept = compacted["replacement_history"]
    assert [item["type"] for item in kept] == ["message"] * len(kept)  # no tool calls or outputs
    assert CODEX_SUMMARY in json.dumps(kept[-1])


def test_node_sdk_responses_ws_runs_a_tool_loop(scripted_url, node_clients):
    proc = subprocess.run(["node", str(node_clients / "responses_ws_loop.mjs"), scripted_url + "/v1", "sk-test", "3"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    turns = result["turns"]
    assert len(turns) == 7  # 3 rounds of (question, tool output) + the bad create after round 0
    bad = turns[2]
    assert bad["events"] == ["error"]
    assert result["errors"] == [{"message": "Previous response with id 'resp_does_not_exist' not found.",
                                 "code": "previous_response_not_found", "status": 400}]
    loop = [t for t in turns if t is not bad]
    previous = None
    for n, turn in enumerate(loop):
        final = turn["final"]
        assert final["status"] == "completed"
        assert turn["events"][:2] == ["response.created", "response.in_progress"]
        assert turn["events"][-1] == "response.completed"
        assert turn["request"].get("previous_response_id") == previous
        previous = final["id"]
        if n % 2 == 0:  # the question: the model calls the tool
            [call] = final["output"]
            assert call["type"] == "function_call" and call["name"] == "get_weather"
            assert "city" in json.loads(call["arguments"])
        else:  # the tool output went back: the model answers
            assert final["output"][0]["type"] == "message"
            assert final["output"][0]["content"][0]["text"] == SCRIPTED_ANSWER
        if n:  # each continuation reuses the previous turn's prefix
            assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0
