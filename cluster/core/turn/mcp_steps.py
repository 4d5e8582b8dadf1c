"""A response's remote MCP tools inside its turn: the loop with no client round trip.

At the turn's start (`McpTurn.start`): each server's tools, listed once a context (an
`mcp_list_tools` item already in the context is reused; a new one is listed, through the
cluster's client, and output), and the calls the client approved (`mcp_approval_response`),
run. Both are output before generation and are part of the turn's context as its input, so
the next turn reuses them (`output_as_context` leaves them out of the output side).

While the model generates (`McpTurn.released`): a call of a server's tool becomes an
`mcp_call` item and starts at once, overlapped with the rest of the generation; one that needs
approval becomes an `mcp_approval_request` and the response ends with it. After the engine
call (`McpTurn.settle`): the calls' results, and when the step called only server-run tools, the
turn goes on with the results in its context (`next_step`): no client round trip.

The MCP I/O is a port (`McpPort`, cluster/serving/mcp_client.py); the rest is plain logic."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from cluster.core.events import Event, EventAssembler
from cluster.core.mcp import (ListedTool, McpRefused, McpServer, approval_item, call_item, echoed_tool, list_item,
                              servers_of, tools_from_listing)
from cluster.core.turn.context import normalize_tools
from cluster.protocol.errors import ApiError


class McpPort(Protocol):
    max_calls: int  # MCP calls one response may run

    async def list_tools(self, server: McpServer, tenant: str, trace: Any = None) -> list[ListedTool]: ...

    async def call_tool(self, server: McpServer, tenant: str, name: str, arguments: str, trace: Any = None) -> str: ...


def without_credentials(tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The request's tools as a response keeps them: an `mcp` tool's headers are never stored."""
    return [echoed_tool(t) if t.get("type") == "mcp" else t for t in tools or []]


@dataclass
class McpTurn:
    """One response's MCP servers, what its model may call on them, and its calls in flight."""

    port: McpPort
    owner: str
    max_calls: int
    trace: Any = None
    servers: dict[str, McpServer] = field(default_factory=dict)  # label -> server
    tools: dict[str, tuple[McpServer, ListedTool]] = field(default_factory=dict)  # tool name -> its server
    before: list[dict[str, Any]] = field(default_factory=list)  # items output before generation
    running: dict[str, "asyncio.Task[str]"] = field(default_factory=dict)  # item id -> its call
    refused: dict[str, str] = field(default_factory=dict)  # item id -> why it was not run
    request: Any = None  # the request as the model sees it (the servers' tools as functions)
    answer_only: bool = False  # its calls reached the bound: the next step may not call (`tool_choice: none`)
    calls: int = 0

    @classmethod
    async def start(cls, port: Optional[McpPort], tools: list[dict[str, Any]], context: list[dict[str, Any]],
                    new_input: list[dict[str, Any]], owner: str, max_calls: int, trace: Any = None) -> "McpTurn":
        if port is None:
            raise ApiError(400, "This server does not run MCP tools.", param="tools", code="unsupported_value")
        turn = cls(port, owner, max_calls, trace)
        seen = [*context, *new_input]
        listed = {i["server_label"]: i for i in seen if i.get("type") == "mcp_list_tools" and not i.get("error")}
        for server in servers_of(tools):
            turn.servers[server.label] = server
            known = listed.get(server.label)
            if known is not None:
                try:
                    found = tools_from_listing(known.get("tools") or [])
                except McpRefused:
                    found = []
            else:
                try:
                    found = await port.list_tools(server, owner, trace)
                    turn.before.append(list_item(server, found))
                except McpRefused as err:
                    found = []
                    turn.before.append(list_item(server, [], error=str(err)))
            for tool in found:
                if server.allows(tool) and tool.name not in turn.tools:  # two servers' same name: the first's
                    turn.tools[tool.name] = (server, tool)
        # A name the model may call as the client's function and as a server's tool: nothing says
        # which runs, so the request is refused rather than one of them silently taken.
        for spec in normalize_tools(tools):
            name = spec["function"]["name"]
            if name in turn.tools:
                raise ApiError(400, f"Tool name '{name[:256]}' is both a function tool of this request and a tool of "
                                    f"MCP server '{turn.tools[name][0].label}'; rename the function or leave the "
                                    "tool out of the server's allowed_tools.", param="tools", code="invalid_value")
        await turn._run_approved(seen, new_input)
        return turn

    async def _run_approved(self, seen: list[dict[str, Any]], new_input: list[dict[str, Any]]) -> None:
        requests = {i["id"]: i for i in seen if i.get("type") == "mcp_approval_request"}
        # A history sent back whole holds earlier approvals too: each request's call runs once.
        ran = {i.get("approval_request_id") for i in seen if i.get("type") == "mcp_call"}
        for answer in new_input:
            if answer.get("type") != "mcp_approval_response" or not answer.get("approve") or \
                    answer["approval_request_id"] in ran:
                continue
            asked = requests.get(answer["approval_request_id"])
            server = self.servers.get(asked["server_label"]) if asked is not None else None
            if asked is None or server is None:
                raise ApiError(400, f"No MCP approval request '{answer['approval_request_id'][:256]}' of a server "
                                    "in this request's tools.", param="input", code="invalid_value")
            offered = self.tools.get(asked["name"])
            if offered is None or offered[0].label != server.label:
                # An approval runs only what the model could have called under this request's
                # `allowed_tools` (a request item written by the client is not a way around them).
                raise ApiError(400, f"MCP approval request '{asked['id'][:256]}' names tool '{asked['name'][:256]}', "
                                    f"which server '{server.label}' does not offer under this request's tools "
                                    "(allowed_tools, or not listed).", param="input", code="invalid_value")
            item = call_item(server.label, asked["name"], asked["arguments"], approval_request_id=asked["id"])
            self._start_call(item, server)
            await self._finish(item)
            self.before.append(item)

    def function_specs(self) -> list[dict[str, Any]]:
        """What the model is offered of the servers' tools (as function tools)."""
        return [tool.function_spec() for _, tool in self.tools.values()]

    def offered(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The request's tools as the model sees them: its `mcp` ones as their servers' functions."""
        return [t for t in tools if t.get("type") != "mcp"] + self.function_specs()

    def tool_choice(self, choice: Any) -> Any:
        """`{type: "mcp", server_label, name}` as the function choice it means (no name: a call is required)."""
        if isinstance(choice, dict) and choice.get("type") == "mcp":
            name = choice.get("name")
            if name is None:
                return "required"
            if name not in self.tools:
                raise ApiError(400, f"Tool choice '{name}' is not a tool of MCP server "
                                    f"'{choice.get('server_label')}'.", param="tool_choice", code="invalid_value")
            return {"type": "function", "name": name}
        return choice

    # -- while the model generates ----------------------------------------------------
    def released(self, asm: EventAssembler, name: str, arguments: str) -> Optional[list[Event]]:
        """A tool call the model made: its events, if it is a server's tool (None: a client's)."""
        found = self.tools.get(name)
        if found is None:
            return None
        server, tool = found
        if server.needs_approval(tool):
            return item_events(asm, approval_item(server.label, name, arguments))
        item = call_item(server.label, name, arguments)
        events = item_events(asm, item, done=False)
        events += [asm.event("response.mcp_call_arguments.delta", item_id=item["id"], output_index=asm.output_index,
                           delta=arguments),
                   asm.event("response.mcp_call_arguments.done", item_id=item["id"], output_index=asm.output_index,
                           arguments=arguments),
                   asm.event("response.mcp_call.in_progress", item_id=item["id"], output_index=asm.output_index)]
        self._start_call(item, server)
        return events

    def _start_call(self, item: dict[str, Any], server: McpServer) -> None:
        if self.calls >= self.max_calls:
            self.refused[item["id"]] = f"This response made {self.max_calls} MCP calls, the most one may make."
            return
        self.calls += 1
        self.running[item["id"]] = asyncio.ensure_future(
            self.port.call_tool(server, self.owner, item["name"], item["arguments"], self.trace))

    async def _finish(self, item: dict[str, Any]) -> None:
        refused = self.refused.pop(item["id"], None)
        task = self.running.pop(item["id"], None)
        try:
            if refused is not None:
                raise McpRefused(refused)
            item["output"] = await task
            item["status"] = "completed"
        except McpRefused as err:
            item["error"], item["status"] = err.error(), "failed"

    async def settle(self, asm: EventAssembler, output_start: int) -> list[Event]:
        """The step's calls, each awaited: their results' events."""
        events: list[Event] = []
        for index, item in enumerate(asm.response["output"]):
            if index >= output_start and item.get("type") == "mcp_call" and item.get("status") == "calling":
                await self._finish(item)
                kind = "completed" if item["status"] == "completed" else "failed"
                events.append(asm.event(f"response.mcp_call.{kind}", item_id=item["id"], output_index=index))
                events.append(asm.event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def cancel(self) -> None:
        for task in self.running.values():
            task.cancel()
        self.running.clear()

    def continues(self, output: list[dict[str, Any]]) -> bool:
        """The step called server-run tools only (no client function call, nothing awaiting
        approval): the response goes on. Once its calls reach the bound, one last step answers
        (`answer_only`); a model that calls on even then ends there."""
        kinds = {item.get("type") for item in output}
        if "mcp_call" not in kinds or kinds & {"function_call", "mcp_approval_request"} or self.answer_only:
            return False
        self.answer_only = self.calls >= self.max_calls
        return True


def item_events(asm: EventAssembler, item: dict[str, Any], done: bool = True) -> list[Event]:
    """An MCP item output whole (a tool list, an approval request) or opened (a call)."""
    events = asm.open_item(item)
    index = asm.output_index
    if item["type"] == "mcp_list_tools":
        kind = "failed" if item.get("error") else "completed"
        events.append(asm.event("response.mcp_list_tools.in_progress", item_id=item["id"], output_index=index))
        events.append(asm.event(f"response.mcp_list_tools.{kind}", item_id=item["id"], output_index=index))
    elif item["type"] == "mcp_call" and done:
        kind = "completed" if item.get("status") == "completed" else "failed"
        events.append(asm.event("response.mcp_call.in_progress", item_id=item["id"], output_index=index))
        events.append(asm.event(f"response.mcp_call.{kind}", item_id=item["id"], output_index=index))
    if done:
        events.append(asm.event("response.output_item.done", output_index=index, item=dict(item)))
    return events
