"""Remote MCP tools, the sans-I/O part (cluster/core/mcp.py): a request's `mcp` tools parsed as
OpenAI defines them, where the cluster may connect, approvals, and the tool lists' bounds."""

import pytest

from cluster.core.mcp import (ListedTool, McpRefused, McpServer, ToolLists, UrlPolicy, echoed_tool, result_text,
                              servers_of, tools_from_listing)
from cluster.protocol.errors import ApiError

READ = ListedTool("read_note", {"type": "object"}, annotations={"readOnlyHint": True})
WRITE = ListedTool("write_note", {"type": "object"})


def server(**tool) -> McpServer:
    return servers_of([{"type": "mcp", "server_label": "notes", "server_url": "https://mcp.example.com/mcp", **tool}])[0]


def test_approval_is_required_unless_the_request_says_otherwise():
    assert server().needs_approval(WRITE) and server().needs_approval(READ)  # OpenAI's default
    assert not server(require_approval="never").needs_approval(WRITE)
    filtered = server(require_approval={"never": {"tool_names": ["read_note"]}, "always": {"tool_names": ["x"]}})
    assert not filtered.needs_approval(READ) and filtered.needs_approval(WRITE)
    assert not server(require_approval={"never": {"read_only": True}}).needs_approval(READ)


def test_allowed_tools_by_name_or_read_only():
    assert server(allowed_tools=["read_note"]).allows(READ) and not server(allowed_tools=["read_note"]).allows(WRITE)
    ro = server(allowed_tools={"read_only": True})
    assert ro.allows(READ) and not ro.allows(WRITE)
    assert server().allows(WRITE)


def test_credentials_are_kept_apart_from_what_is_echoed_and_key_the_tool_lists():
    tool = {"type": "mcp", "server_label": "a", "server_url": "https://h/mcp", "headers": {"X-Key": "secret"},
            "authorization": "tok"}
    parsed = servers_of([tool])[0]
    assert dict(parsed.headers) == {"X-Key": "secret", "Authorization": "Bearer tok"}
    assert "headers" not in echoed_tool(tool) and "authorization" not in echoed_tool(tool)
    other = servers_of([{**tool, "authorization": "other"}])[0]
    assert parsed.list_key("t") != other.list_key("t") != parsed.list_key("u")
    assert "secret" not in repr(parsed.list_key("t"))


@pytest.mark.parametrize("tool, param", [
    ({"server_url": "https://h/mcp"}, "tools[0].server_label"),
    ({"server_label": "a"}, "tools[0].server_url"),
    ({"server_label": "a", "server_url": "https://h", "connector_id": "connector_gmail"}, "tools[0].connector_id"),
    ({"server_label": "a", "server_url": "https://h", "require_approval": "sometimes"}, "tools[0].require_approval"),
    ({"server_label": "a", "server_url": "https://h", "allowed_tools": "add"}, "tools[0].allowed_tools"),
    ({"server_label": "a", "server_url": "https://h", "headers": {"k": 1}}, "tools[0].headers"),
])
def test_a_malformed_mcp_tool_is_a_400_naming_its_field(tool, param):
    with pytest.raises(ApiError) as err:
        servers_of([{"type": "mcp", **tool}])
    assert err.value.status == 400 and err.value.param == param


def test_two_tools_on_one_label_are_refused():
    with pytest.raises(ApiError):
        servers_of([{"type": "mcp", "server_label": "a", "server_url": "https://h"}] * 2)


def test_the_url_policy_refuses_private_networks_plain_http_and_unlisted_hosts():
    policy = UrlPolicy([], allow_private=False, allow_http=False)
    assert policy.host_of("https://mcp.example.com/mcp") == ("mcp.example.com", 443)
    for url in ("http://mcp.example.com/mcp", "ftp://x/y", "https://user:pw@h/mcp", "https:///mcp", "https://[::1"):
        with pytest.raises(McpRefused):
            policy.host_of(url)
    for addresses in (["127.0.0.1"], ["93.184.216.34", "10.0.0.5"], ["169.254.169.254"], ["::1"], ["fe80::1%eth0"],
                      ["192.168.1.1"], []):
        with pytest.raises(McpRefused):
            policy.check_addresses("h", addresses)
    policy.check_addresses("h", ["93.184.216.34", "2606:2800:220:1::1"])
    listed = UrlPolicy(["*.corp.example", "tools.example.com"], allow_private=True, allow_http=True)
    assert listed.host_of("http://a.corp.example:8080/mcp") == ("a.corp.example", 8080)
    listed.check_addresses("a.corp.example", ["10.1.2.3"])
    with pytest.raises(McpRefused):
        listed.host_of("https://evil.example.org/mcp")


def test_tool_lists_expire_and_are_bounded():
    lists = ToolLists(ttl_s=10, max_lists=2)
    lists.put(("t", "u1", "h"), [READ], now=0)
    assert lists.get(("t", "u1", "h"), now=5) == [READ] and lists.get(("t", "u1", "h"), now=10) is None
    for n in range(3):
        lists.put(("t", f"u{n}", "h"), [READ], now=20)
    assert lists.get(("t", "u0", "h"), now=21) is None and lists.get(("t", "u2", "h"), now=21) == [READ]


def test_a_listing_and_a_result_as_the_model_reads_them():
    tools = tools_from_listing([{"name": "add", "inputSchema": {"type": "object"}, "description": "Add."}])
    assert tools[0].function_spec() == {"type": "function", "name": "add", "description": "Add.",
                                        "parameters": {"type": "object"}}
    with pytest.raises(McpRefused):
        tools_from_listing([{"description": "no name"}])
    assert result_text([{"type": "text", "text": "3"}]) == "3"
    assert result_text([], {"sum": 3}) == '{"sum": 3}'
