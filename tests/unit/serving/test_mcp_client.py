"""The cluster's MCP client (cluster/serving/mcp_client.py) against a real MCP server (the `mcp`
package's MCPServer over streamable HTTP, on a local port) and servers that misbehave: every
failure is a clear `McpRefused`, bounded in time and bytes, and the client keeps working."""

import asyncio
import time

import pytest

from cluster.config.mcp import McpConfig
from cluster.core.mcp import McpRefused, McpServer
from cluster.serving.mcp_client import McpClient
from cluster.bench.mcp_server import McpTestServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def base_url():
    with McpTestServer() as url:
        yield url


def client(**config) -> McpClient:
    # The test server is on loopback: an operator's own network, allowed as a config would.
    return McpClient(McpConfig(**{"allow_private_networks": True, "allow_http": True, "call_timeout_s": 3,
                                  "list_timeout_s": 3, **config}))


def at(url: str, path: str = "/mcp") -> McpServer:
    return McpServer("tools", url + path)


async def test_lists_and_calls_the_servers_tools(base_url):
    c = client()
    tools = await c.list_tools(at(base_url), "t")
    assert [t.name for t in tools] == ["add", "read_note", "write_note", "advance"]
    assert tools[1].read_only and not tools[2].read_only
    assert tools[0].input_schema["properties"].keys() == {"a", "b"}
    assert await c.call_tool(at(base_url), "t", "add", '{"a": 2, "b": 40}') == "42"
    assert await c.call_tool(at(base_url), "t", "write_note", '{"key": "k", "text": "hello"}') == "saved 'k'"
    assert await c.call_tool(at(base_url), "t", "read_note", '{"key": "k"}') == "hello"
    assert len(c._sessions) == 1  # one session held for the tenant's server, not one a call
    with pytest.raises(McpRefused, match="arguments"):
        await c.call_tool(at(base_url), "t", "add", "not json")
    with pytest.raises(McpRefused):  # the tool's own error (a missing argument)
        await c.call_tool(at(base_url), "t", "add", '{"a": 1}')


async def test_a_tool_list_is_reused_per_tenant_until_its_ttl(base_url, monkeypatch):
    c = client(tools_ttl_s=60)
    calls = []
    real = c._session
    monkeypatch.setattr(c, "_session", lambda server, work, tenant: calls.append(1) or real(server, work, tenant))
    await c.list_tools(at(base_url), "t")
    await c.list_tools(at(base_url), "t")
    assert len(calls) == 1
    await c.list_tools(at(base_url), "u")  # another key lists for itself
    assert len(calls) == 2


@pytest.mark.parametrize("path, message", [
    ("/hang/mcp", "did not answer within 3 s"),
    ("/huge/mcp", "answered more than 1048576 bytes"),
    ("/garbage/mcp", "did not answer with valid MCP"),
    ("/redirect/mcp", "redirected the request elsewhere"),
    ("/no-such-path/mcp", "answered with an error"),
])
async def test_a_misbehaving_server_fails_clearly_in_bounded_time_and_the_client_keeps_working(base_url, path,
                                                                                              message):
    c = client()
    started = time.monotonic()
    with pytest.raises(McpRefused, match=message):
        await c.list_tools(at(base_url, path), "t")
    assert time.monotonic() - started < 10
    assert c._in_flight == {} and c._sessions == {}  # nothing left counted, no failed session kept
    assert await c.call_tool(at(base_url), "t", "add", '{"a": 1, "b": 1}') == "2"


async def test_private_addresses_and_plain_http_are_refused_before_connecting(base_url):
    strict = McpClient(McpConfig(allow_http=True))  # the default: public addresses only
    with pytest.raises(McpRefused, match="non-public address"):
        await strict.list_tools(at(base_url), "t")
    with pytest.raises(McpRefused, match="https"):
        await McpClient(McpConfig()).list_tools(at(base_url), "t")

    async def public(host, port):  # the test's stand-in for DNS: this name resolves to a metadata address
        return ["169.254.169.254"]

    with pytest.raises(McpRefused, match="non-public"):
        await McpClient(McpConfig(allow_http=True), resolver=public).list_tools(
            McpServer("x", "http://metadata.example.com/mcp"), "t")


async def test_a_keys_concurrent_exchanges_are_bounded(base_url):
    c = client(max_concurrent_calls_per_tenant=1)
    slow = asyncio.ensure_future(c.list_tools(at(base_url, "/hang/mcp"), "t"))
    await asyncio.sleep(0.2)
    with pytest.raises(McpRefused, match="in flight"):
        await c.call_tool(at(base_url), "t", "add", '{"a": 1, "b": 1}')
    assert await c.call_tool(at(base_url), "u", "add", '{"a": 1, "b": 1}') == "2"  # another key is not held
    with pytest.raises(McpRefused):
        await slow


async def test_the_connection_goes_to_the_address_that_was_checked(base_url):
    """The name is resolved once, checked, and connected to at that address: `mcp.invalid`
    (which no real resolver answers) reaches the test server only through the checked answer,
    and a name checked as public is never connected to at whatever it resolves to next."""
    port = int(base_url.rsplit(":", 1)[1])
    asked = []

    async def checked(host, port_):  # the test's stand-in for DNS
        asked.append(host)
        return ["127.0.0.1"]

    pinned = McpClient(McpConfig(allow_private_networks=True, allow_http=True, list_timeout_s=3), resolver=checked)
    tools = await pinned.list_tools(McpServer("tools", f"http://mcp.invalid:{port}/mcp"), "t")
    assert [t.name for t in tools] == ["add", "read_note", "write_note", "advance"] and set(asked) == {"mcp.invalid"}

    async def public_then_loopback(host, port_):  # checked as public: 192.0.0.9 (a global address no route reaches)
        return ["192.0.0.9"]

    rebinding = McpClient(McpConfig(allow_http=True, list_timeout_s=2), resolver=public_then_loopback)
    with pytest.raises(McpRefused):  # it went to the checked address, not to localhost where the server is
        await rebinding.list_tools(McpServer("tools", f"http://localhost:{port}/mcp"), "t")
