"""The same N-step tool loop run by the client against run by the server (remote MCP tools).

    loopserve bench mcp-loop --steps 10 --rounds 3                 # scripted engine, h100-8b speed
    loopserve bench mcp-loop --engine vllm --steps 10 --rounds 2   # the real CPU engine (local.yaml)

A real MCP server (cluster/bench/mcp_server.py, streamable HTTP, in this process) has the tool
`advance(step)`; the task is `steps` calls of it, then an answer. Client-side: `advance` is a
function tool, the client calls the MCP server itself (the `mcp` package's client) and sends
each result back on a held WebSocket (`previous_response_id`, only new items): a round trip a
step. Server-side: `advance` is offered through an `mcp` tool (`require_approval: never`) and the
cluster calls it, one response for the whole task. Rounds alternate which goes first.

The scripted engine follows the task by rules (`task_rules`). The real engine is forced to call
(`tool_choice` of the tool) for `steps` steps; the server-side run ends at the same count
(`mcp.max_calls_per_response`), the client-side run with one `tool_choice: none` turn.
Reported per mode: client-clock completion, engine prefill tokens (input less cached, every
engine call), and each engine call's time to its first output (TTFT: from the request, or from
the result of the call before it, to the first token or item).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any, Optional

from cluster.bench.client import ws_turn, ws_url
from cluster.bench.mcp_server import TASK_PROMPT, McpTestServer, task_rules

ADVANCE = {"type": "function", "name": "advance", "description": "Advance the task by one step; answers the step "
           "reached.", "parameters": {"type": "object", "properties": {"step": {"type": "integer"}},
                                      "required": ["step"]}}
INSTRUCTIONS = "Do the task with the advance tool, one step at a time, then say it is done."


def app_args(engine: str, steps: int, engine_model: str, config: str) -> dict[str, Any]:
    """The served config's app (local.yaml: SmolLM2 on vLLM), or the scripted engine at an engine
    model's speed following the task's rules; the MCP server is on this machine."""
    from cluster.bench.session_systems import loopserve_args

    args = loopserve_args(config, engine, 1, None, True, (1500.0, 60.0),
                          engine_model=engine_model if engine == "scripted" else None)
    if engine == "scripted":
        args["engine"]["scripted"]["answer_rules"] = task_rules(steps)
    args["mcp"] = {"allow_private_networks": True, "allow_http": True, "max_calls_per_response": steps}
    return args


async def client_side(url: str, model: str, mcp_url: str, steps: int, forced: bool) -> dict[str, Any]:
    """The client runs the loop: each call is a round trip through it."""
    from mcp.client.client import Client
    from websockets.asyncio.client import connect

    started = time.perf_counter()
    prefill, decoded, ttft, calls = 0, 0, [], 0
    async with Client(mcp_url) as tools, connect(ws_url(url), max_size=None, open_timeout=30) as ws:
        body: dict[str, Any] = {"model": model, "instructions": INSTRUCTIONS, "tools": [ADVANCE],
                                "input": TASK_PROMPT, "store": False,
                                "max_output_tokens": 4096}
        while True:
            if forced:
                body["tool_choice"] = {"type": "function", "name": "advance"} if calls < steps else "none"
            turn = await ws_turn(ws, body, timeout=600)
            response = turn.last["response"]
            usage = response["usage"]
            prefill += usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]
            decoded += usage["output_tokens"]
            ttft.append(turn.first_token_s)
            call = next((o for o in response["output"] if o["type"] == "function_call"), None)
            if call is None:
                break
            calls += 1
            result = await tools.call_tool("advance", json.loads(call["arguments"] or "{}"))
            text = "\n".join(getattr(c, "text", "") for c in result.content)
            body = {**body, "previous_response_id": response["id"],
                    "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": text}]}
    return {"done_s": time.perf_counter() - started, "prefill_tokens": prefill, "output_tokens": decoded, "calls": calls,
            "engine_calls": len(ttft), "ttft_s": ttft}


async def server_side(url: str, model: str, mcp_url: str, forced: bool) -> dict[str, Any]:
    """The cluster runs the loop: one response, each step's first output event timed."""
    from websockets.asyncio.client import connect

    tool = {"type": "mcp", "server_label": "tasks", "server_url": mcp_url, "allowed_tools": ["advance"],
            "require_approval": "never"}
    body: dict[str, Any] = {"model": model, "instructions": INSTRUCTIONS, "tools": [tool], "input": TASK_PROMPT,
                            "store": False, "max_output_tokens": 4096}
    if forced:
        body["tool_choice"] = {"type": "mcp", "server_label": "tasks", "name": "advance"}
    ttft: list[float] = []
    started = time.perf_counter()
    ready = [started]  # when the step's input was there: the request sent, then each call's result

    async def on_event(ev: dict) -> None:
        # A step's first output: its first item after the results of the calls before it.
        kind = ev.get("type", "")
        if kind == "response.output_item.added" and ev["item"]["type"] in ("mcp_call", "message") and ready:
            ttft.append(time.perf_counter() - ready.pop())
        elif kind in ("response.mcp_call.completed", "response.mcp_call.failed"):
            ready[:] = [time.perf_counter()]

    async with connect(ws_url(url), max_size=None, open_timeout=30) as ws:
        turn = await ws_turn(ws, body, timeout=600, on_event=on_event)
    response = turn.last["response"]
    usage = response["usage"]
    calls = [o for o in response["output"] if o["type"] == "mcp_call"]
    if response["status"] != "completed" or any(c.get("error") for c in calls):
        print(f"server-side: {response['status']} {response.get('incomplete_details')} "
              f"{[c.get('error') for c in calls if c.get('error')][:1]}", flush=True)
    return {"done_s": turn.wall_s, "prefill_tokens": usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"],
            "output_tokens": usage["output_tokens"],
            "calls": sum(1 for c in calls if c.get("status") == "completed"), "engine_calls": len(ttft),
            "ttft_s": ttft}


def report(rows: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| run | done s (median) | rounds | prefill tokens | output tokens | MCP calls | engine calls | TTFT p50 s |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, runs in rows.items():
        done = [r["done_s"] for r in runs]
        ttft = [t for r in runs for t in r["ttft_s"]]
        lines.append(f"| {mode} | {statistics.median(done):.2f} | {', '.join(f'{d:.2f}' for d in done)} | "
                     f"{statistics.median(r['prefill_tokens'] for r in runs):.0f} | "
                     f"{statistics.median(r['output_tokens'] for r in runs):.0f} | {runs[-1]['calls']} | "
                     f"{runs[-1]['engine_calls']} | {statistics.median(ttft):.3f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="loopserve bench mcp-loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["scripted", "vllm"], default="scripted")
    ap.add_argument("--engine-model", default="h100-8b", help="scripted engine: its engine model")
    ap.add_argument("--config", default="serve_configs/local.yaml", help="vllm: the served config")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args(argv)
    from cluster.bench.common import deploy, start_cluster, stop_cluster

    forced = ns.engine == "vllm"  # a real model is held to the task by tool_choice
    rows: dict[str, list[dict[str, Any]]] = {"client-side (function tools)": [], "server-side (mcp)": []}
    with McpTestServer() as mcp_base:
        mcp_url = mcp_base + "/mcp"
        base = start_cluster()
        try:
            url = deploy(base, "mcploop", app_args(ns.engine, ns.steps, ns.engine_model, ns.config), timeout=900)
            model = json.loads(__import__("httpx").get(url + "/v1/models", timeout=30).text)["data"][0]["id"]
            for r in range(ns.rounds):
                order = ["client", "server"] if r % 2 == 0 else ["server", "client"]
                for mode in order:
                    if mode == "client":
                        rows["client-side (function tools)"].append(
                            asyncio.run(client_side(url, model, mcp_url, ns.steps, forced)))
                    else:
                        rows["server-side (mcp)"].append(asyncio.run(server_side(url, model, mcp_url, forced)))
                print(f"round {r + 1}/{ns.rounds}: " + ", ".join(f"{m} {v[-1]['done_s']:.2f} s" for m, v in rows.items()),
                      flush=True)
        finally:
            stop_cluster()
    print(f"\n{ns.steps}-step tool loop, engine {ns.engine}"
          f"{' (' + ns.engine_model + ')' if ns.engine == 'scripted' else ''}, {ns.rounds} rounds, one WebSocket each\n")
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
