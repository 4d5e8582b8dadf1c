"""The remote MCP items a request's input may carry (`openai.types.responses`): what a response on
an `mcp` tool output (a tool list, a call, an approval request) sent back as history, and the
client's answer to an approval request."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_ID_CHARS = 256


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


class McpListToolsItem(_Item):
    type: Literal["mcp_list_tools"]
    id: Optional[str] = Field(default=None, max_length=MAX_ID_CHARS)
    server_label: str = Field(max_length=64)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    error: Optional[str] = None


class McpCallItem(_Item):
    type: Literal["mcp_call"]
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    server_label: str = Field(max_length=64)
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    arguments: str
    output: Optional[str] = None
    error: Union[str, dict[str, Any], None] = None  # OpenAI's typed errors (protocol, tool execution, http)
    status: Optional[str] = None
    approval_request_id: Optional[str] = Field(default=None, max_length=MAX_ID_CHARS)


class McpApprovalRequestItem(_Item):
    type: Literal["mcp_approval_request"]
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    server_label: str = Field(max_length=64)
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    arguments: str


class McpApprovalResponseItem(_Item):
    type: Literal["mcp_approval_response"]
    approval_request_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    approve: bool
    id: Optional[str] = Field(default=None, max_length=MAX_ID_CHARS)
    reason: Optional[str] = None


MCP_ITEM_TYPES = ("mcp_list_tools", "mcp_call", "mcp_approval_request", "mcp_approval_response")
