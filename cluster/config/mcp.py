"""`mcp`: remote MCP servers the server itself calls (`tools: [{"type": "mcp", ...}]`)."""

from __future__ import annotations

from pydantic import Field

from cluster.config.base import StrictModel


class McpConfig(StrictModel):
    """Remote MCP tools: where the cluster may connect, and how much one response may spend there."""

    enabled: bool = True
    """Serve `mcp` tools. Off: a request with one is refused (`unsupported_value`)."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host names (exact, or `*.example.com`) a `server_url` may name. Empty: any host whose addresses are all
    public."""
    allow_private_networks: bool = False
    """Let `server_url` reach loopback, link-local, private and other non-public addresses (an operator's own
    MCP servers inside the cluster's network). Off, every address a host resolves to must be public: a request
    cannot make the cluster call its own metadata service or internal ports."""
    allow_http: bool = False
    """Plain `http://` server URLs (else `https://` only: the request's `headers` carry credentials)."""
    call_timeout_s: float = Field(30.0, gt=0)
    """One tool call, connect to result: past it the `mcp_call` fails with a timeout error."""
    list_timeout_s: float = Field(10.0, gt=0)
    """Listing a server's tools."""
    max_result_bytes: int = Field(1024 * 1024, ge=1024)
    """Bytes of one MCP response the cluster reads (a tool list or a call's result): past it the call fails,
    and what was read is dropped."""
    max_calls_per_response: int = Field(16, ge=1)
    """MCP calls one response may run (its steps together)."""
    max_concurrent_calls_per_tenant: int = Field(8, ge=1)
    """MCP requests one key may have in flight on a connection replica."""
    tools_ttl_s: float = Field(300.0, ge=0)
    """How long a server's tool list is reused (per server URL, headers and tenant) before it is listed again."""
    max_cached_lists: int = Field(1024, ge=1)
    """Tool lists kept on a connection replica (least recently used go first)."""
