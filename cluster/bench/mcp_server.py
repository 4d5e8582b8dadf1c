"""A real MCP server for benchmarks and tests (the `mcp` package's `MCPServer`, streamable HTTP,
in a thread of the calling process): tools to add numbers, keep notes and advance a task by one
step, and routes that misbehave as a bad server would: one that never answers, one that answers
50 MB, one that answers what is not JSON-RPC, one that redirects to the cloud metadata address.

`task_rules` script the scripted engine through a task of N steps on `advance` (each step's
result names the next): the same tool loop, run by the server (`mcp` tools) or by a client
(function tools, the client calling this server itself)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Optional

NOTES: dict[str, str] = {}
HUGE_BYTES = 50 * 1024 * 1024
TEST_HOST = "mcp.invalid"  # a name no real resolver answers (RFC 6761)


def build_server():
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations
    from starlette.responses import JSONResponse, RedirectResponse, Response

    server = MCPServer("loopserve-test-tools")

    @server.tool(description="Add two integers.")
    def add(a: int, b: int) -> int:
        return a + b

    @server.tool(description="Read a note by its key.", annotations=ToolAnnotations(readOnlyHint=True))
    def read_note(key: str) -> str:
        return NOTES.get(key, f"no note '{key}'")

    @server.tool(description="Write a note under a key.")
    def write_note(key: str, text: str) -> str:
        NOTES[key] = text
        return f"saved '{key}'"

    @server.tool(description="Advance the task by one step; answers the step reached.")
    def advance(step: int) -> str:
        return f"STEP-{step + 1} reached"

    @server.custom_route("/hang/mcp", methods=["POST", "GET", "DELETE"])
    async def hang(request):
        await asyncio.sleep(3600)
        return Response(b"")

    @server.custom_route("/huge/mcp", methods=["POST", "GET", "DELETE"])
    async def huge(request):
        return Response(b'{"jsonrpc": "2.0", "id": 1, "result": "' + b"x" * HUGE_BYTES + b'"}',
                        media_type="application/json")

    @server.custom_route("/garbage/mcp", methods=["POST", "GET", "DELETE"])
    async def garbage(request):
        return JSONResponse({"not": "json-rpc", "id": "?"})

    @server.custom_route("/redirect/mcp", methods=["POST", "GET", "DELETE"])
    async def redirect(request):
        return RedirectResponse("http://169.254.169.254/latest/meta-data/mcp", status_code=307)

    return server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class McpTestServer:
    """`with McpTestServer() as url:` the server's base URL (`url + "/mcp"` is the MCP endpoint)."""

    def __init__(self, port: Optional[int] = None) -> None:
        self.port = port or free_port()
        self._server = None
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> str:
        import uvicorn

        from mcp.server.transport_security import TransportSecuritySettings

        # The server's own DNS-rebinding guard, as it sets it for loopback, plus the name the
        # client tests resolve through their stand-in resolver (`mcp.invalid`).
        guard = TransportSecuritySettings(enable_dns_rebinding_protection=True,
                                          allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*", f"{TEST_HOST}:*"],
                                          allowed_origins=["http://127.0.0.1:*", "http://localhost:*"])
        app = build_server().streamable_http_app(json_response=True, stateless_http=True, transport_security=guard)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)


TASK_PROMPT = "Run the task, one step at a time."
TASK_DONE = "The task is done."


def task_rules(steps: int, tool_parser: str = "hermes") -> list[dict]:
    """Scripted-engine rules: after STEP-n it calls `advance(step=n)`, after STEP-`steps` it answers,
    and first (the task's prompt alone) it calls `advance(step=0)`. Latest step first: rules match
    the whole prompt, and every earlier step's result stays in it."""
    from cluster.engines.scripted.engine import written_calls

    rules = [{"contains": f"STEP-{steps} reached", "text": TASK_DONE}]
    rules += [{"contains": f"STEP-{n} reached", "text": written_calls(tool_parser, [("advance", {"step": n})])}
              for n in range(steps - 1, 0, -1)]
    return rules + [{"contains": TASK_PROMPT, "text": written_calls(tool_parser, [("advance", {"step": 0})])}]
