"""Remote MCP tools, the sans-I/O part: a request's `mcp` tools as servers the cluster may call,
the checks on where they point, the tool lists kept per server and tenant, and the items a
response shows for them (`mcp_list_tools`, `mcp_call`, `mcp_approval_request`).

The I/O (DNS, HTTP, the MCP session) is cluster/serving/mcp_client.py's: it asks this module
before it connects anywhere, and hands back what the server said as plain values."""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from cluster.protocol.errors import ApiError
from cluster.protocol.ids import new_id

MAX_LABEL_CHARS, MAX_URL_CHARS, MAX_HEADERS_BYTES = 64, 2048, 16 * 1024
APPROVAL_MODES = ("always", "never")


class McpRefused(Exception):
    """A server the cluster will not call, or an MCP exchange that failed: the message is safe to
    show the client (it never holds the request's headers). `tool_error`: the tool ran and
    reported an error (its content), rather than the exchange failing."""

    def __init__(self, message: str, tool_error: Optional[list[dict[str, Any]]] = None) -> None:
        super().__init__(message)
        self.tool_error = tool_error

    def error(self) -> dict[str, Any]:
        """The `mcp_call` item's `error` as OpenAI types it."""
        if self.tool_error is not None:
            return {"type": "mcp_tool_execution_error", "content": self.tool_error}
        return {"type": "mcp_protocol_error", "code": -32000, "message": str(self)}


@dataclass(frozen=True)
class ListedTool:
    """One tool as a server lists it (`mcp_list_tools`' `tools`)."""

    name: str
    input_schema: dict[str, Any]
    description: Optional[str] = None
    annotations: Optional[dict[str, Any]] = None

    @property
    def read_only(self) -> bool:
        return bool((self.annotations or {}).get("readOnlyHint"))

    def listed(self) -> dict[str, Any]:
        return {"name": self.name, "input_schema": self.input_schema, "description": self.description,
                "annotations": self.annotations}

    def function_spec(self) -> dict[str, Any]:
        """What the model is offered: a function tool of the same name and schema."""
        return {"type": "function", "name": self.name, "description": self.description or "",
                "parameters": self.input_schema or {"type": "object", "properties": {}}}


def _names(value: Any, where: str) -> tuple[Optional[frozenset[str]], bool]:
    """`allowed_tools` / an approval filter: a list of names, or `{tool_names, read_only}`."""
    if value is None:
        return None, False
    if isinstance(value, list) and all(isinstance(n, str) for n in value):
        return frozenset(value), False
    if isinstance(value, dict):
        names = value.get("tool_names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ApiError(400, f"Invalid '{where}.tool_names': expected an array of tool names.", param=where,
                           code="invalid_type")
        return (frozenset(names) if names is not None else None), bool(value.get("read_only"))
    raise ApiError(400, f"Invalid '{where}': expected an array of tool names or a filter object.", param=where,
                   code="invalid_type")


@dataclass(frozen=True)
class McpServer:
    """One `mcp` tool of a request: the server and what of it the model may use."""

    label: str
    url: str
    headers: tuple[tuple[str, str], ...] = ()  # never stored, echoed or logged
    allowed: Optional[frozenset[str]] = None  # None: every tool it lists
    allowed_read_only: bool = False
    approval: str = "always"  # for tools no filter below names
    always: frozenset[str] = frozenset()
    never: frozenset[str] = frozenset()
    never_read_only: bool = False

    @classmethod
    def from_tool(cls, tool: dict[str, Any], index: int) -> "McpServer":
        where = f"tools[{index}]"
        label, url = tool.get("server_label"), tool.get("server_url")
        if not isinstance(label, str) or not 0 < len(label) <= MAX_LABEL_CHARS:
            raise ApiError(400, f"Invalid '{where}.server_label': 1-{MAX_LABEL_CHARS} characters are required.",
                           param=f"{where}.server_label", code="invalid_value")
        if tool.get("connector_id") is not None:
            raise ApiError(400, "Connectors are not served here: give a 'server_url'.", param=f"{where}.connector_id",
                           code="unsupported_value")
        if not isinstance(url, str) or not 0 < len(url) <= MAX_URL_CHARS:
            raise ApiError(400, f"Missing or invalid '{where}.server_url'.", param=f"{where}.server_url",
                           code="invalid_value")
        headers = dict(tool.get("headers") or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise ApiError(400, f"Invalid '{where}.headers': string names and values only.", param=f"{where}.headers",
                           code="invalid_type")
        if isinstance(tool.get("authorization"), str):
            headers["Authorization"] = "Bearer " + tool["authorization"]
        if sum(len(k) + len(v) for k, v in headers.items()) > MAX_HEADERS_BYTES:
            raise ApiError(400, f"Invalid '{where}.headers': more than {MAX_HEADERS_BYTES} bytes.",
                           param=f"{where}.headers", code="invalid_value")
        allowed, allowed_ro = _names(tool.get("allowed_tools"), f"{where}.allowed_tools")
        approval, always, never, never_ro = "always", frozenset(), frozenset(), False
        require = tool.get("require_approval")
        if isinstance(require, str):
            if require not in APPROVAL_MODES:
                raise ApiError(400, f"Invalid '{where}.require_approval': 'always', 'never' or a filter object.",
                               param=f"{where}.require_approval", code="invalid_value")
            approval = require
        elif isinstance(require, dict):
            always = _names(require.get("always"), f"{where}.require_approval.always")[0] or frozenset()
            never, never_ro = _names(require.get("never"), f"{where}.require_approval.never")
            never = never or frozenset()
        elif require is not None:
            raise ApiError(400, f"Invalid '{where}.require_approval'.", param=f"{where}.require_approval",
                           code="invalid_type")
        return cls(label, url, tuple(sorted(headers.items())), allowed, allowed_ro, approval, always, never, never_ro)

    def allows(self, tool: ListedTool) -> bool:
        if self.allowed_read_only and not tool.read_only:
            return False
        return self.allowed is None or tool.name in self.allowed

    def needs_approval(self, tool: ListedTool) -> bool:
        if tool.name in self.always:
            return True
        if tool.name in self.never or (self.never_read_only and tool.read_only):
            return False
        return self.approval == "always"

    def list_key(self, tenant: str) -> tuple[str, str, str]:
        """A tool list is this tenant's, for this URL and these headers (what it may list depends on them)."""
        digest = hashlib.sha256(json.dumps(self.headers).encode()).hexdigest()
        return tenant, self.url, digest


def servers_of(tools: Optional[list[dict[str, Any]]]) -> list[McpServer]:
    servers = [McpServer.from_tool(t, i) for i, t in enumerate(tools or []) if t.get("type") == "mcp"]
    labels = [s.label for s in servers]
    if len(set(labels)) != len(labels):
        raise ApiError(400, "Each mcp tool needs its own 'server_label'.", param="tools", code="invalid_value")
    return servers


def echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An `mcp` tool as the response echoes it: its credentials left out."""
    return {k: v for k, v in tool.items() if k not in ("headers", "authorization")}


class UrlPolicy:
    """Where `server_url` may point (config `mcp`): https (http if allowed), a listed host if
    any are listed, and addresses that are all public unless private networks are allowed."""

    def __init__(self, allowed_hosts: list[str], allow_private: bool, allow_http: bool) -> None:
        self.allowed_hosts = [h.lower() for h in allowed_hosts]
        self.allow_private, self.allow_http = allow_private, allow_http

    def host_of(self, url: str) -> tuple[str, int]:
        """The URL's host and port, once its scheme and host pass; raises `McpRefused`."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise McpRefused("The server_url is not a valid URL.") from None
        if parts.scheme not in (("https", "http") if self.allow_http else ("https",)):
            raise McpRefused(f"The server_url must be {'http(s)' if self.allow_http else 'https'}://.")
        host = (parts.hostname or "").lower()
        if not host or parts.username or parts.password:
            raise McpRefused("The server_url needs a host and no user info.")
        if self.allowed_hosts and not any(fnmatch.fnmatchcase(host, pattern) for pattern in self.allowed_hosts):
            raise McpRefused(f"The host '{host}' is not one this server may call.")
        return host, port or (443 if parts.scheme == "https" else 80)

    def check_addresses(self, host: str, addresses: list[str]) -> None:
        """Every address `host` resolved to must be public (unless private networks are allowed):
        a request cannot make the cluster call its own network."""
        if not addresses:
            raise McpRefused(f"The host '{host}' did not resolve.")
        if self.allow_private:
            return
        for address in addresses:
            ip = ipaddress.ip_address(address.split("%")[0])
            if not ip.is_global or ip.is_multicast:
                raise McpRefused(f"The host '{host}' resolves to a non-public address; this server does not call "
                                 "private networks.")


class ToolLists:
    """Tool lists by (tenant, server URL, headers digest), reused for `ttl_s`; at most `max_lists`."""

    def __init__(self, ttl_s: float, max_lists: int) -> None:
        self.ttl_s, self.max_lists = ttl_s, max_lists
        self._lists: "OrderedDict[tuple, tuple[float, list[ListedTool]]]" = OrderedDict()

    def get(self, key: tuple, now: float) -> Optional[list[ListedTool]]:
        found = self._lists.get(key)
        if found is None or now >= found[0]:
            self._lists.pop(key, None)
            return None
        self._lists.move_to_end(key)
        return found[1]

    def put(self, key: tuple, tools: list[ListedTool], now: float) -> None:
        if self.ttl_s <= 0:
            return
        self._lists[key] = (now + self.ttl_s, tools)
        self._lists.move_to_end(key)
        while len(self._lists) > self.max_lists:
            self._lists.popitem(last=False)


def tools_from_listing(raw: list[dict[str, Any]]) -> list[ListedTool]:
    """A server's `tools/list` result as plain tools; a malformed entry fails the list."""
    tools = []
    for entry in raw:
        name, schema = entry.get("name"), entry.get("inputSchema", entry.get("input_schema"))
        if not isinstance(name, str) or not name or (schema is not None and not isinstance(schema, dict)):
            raise McpRefused("The MCP server listed a tool without a name or with an invalid input schema.")
        annotations = entry.get("annotations")
        tools.append(ListedTool(name, schema or {"type": "object", "properties": {}}, entry.get("description"),
                                annotations if isinstance(annotations, dict) else None))
    return tools


def result_text(content: list[dict[str, Any]], structured: Optional[dict[str, Any]] = None) -> str:
    """A `tools/call` result as the text the model reads: its text parts, else its structured content."""
    texts = [part.get("text", "") for part in content if part.get("type") == "text"]
    if texts:
        return "\n".join(texts)
    if structured is not None:
        return json.dumps(structured)
    return json.dumps(content)


# -- what a response shows ----------------------------------------------------------------
def list_item(server: McpServer, tools: list[ListedTool], error: Optional[str] = None) -> dict[str, Any]:
    return {"id": new_id("mcpl"), "type": "mcp_list_tools", "server_label": server.label,
            "tools": [t.listed() for t in tools], "error": error}


def call_item(server_label: str, name: str, arguments: str, approval_request_id: Optional[str] = None) -> dict[str, Any]:
    return {"id": new_id("mcp"), "type": "mcp_call", "server_label": server_label, "name": name,
            "arguments": arguments, "output": None, "error": None, "status": "calling",
            "approval_request_id": approval_request_id}


def approval_item(server_label: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_id("mcpr"), "type": "mcp_approval_request", "server_label": server_label, "name": name,
            "arguments": arguments}
