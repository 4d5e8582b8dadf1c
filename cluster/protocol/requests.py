"""Request validation and admission: the `POST /v1/responses` body and WebSocket client events,
and `admit_create`, the one admission path for every `response.create`, HTTP or WebSocket (the
caller's rate limit, the body parsed and validated once, then the rules of the transport).

Tolerant of unknown keys (clients send `client_metadata`, `stream_options`, ...),
strict on the fields that change behaviour. Validated items are kept as plain
dicts (`model_dump(exclude_none=True)`) so cached history is never re-validated.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)

from cluster.protocol.errors import ApiError, from_validation_error, invalid_request
from cluster.protocol.mcp_items import (MCP_ITEM_TYPES, McpApprovalRequestItem, McpApprovalResponseItem, McpCallItem,
                                        McpListToolsItem)
from cluster.protocol.request_bounds import MAX_JSON_DEPTH, echo_error, json_depth_error  # noqa: F401


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Tolerant):
    # input_text / output_text / refusal / input_image / input_file / summary_text ...
    type: str
    text: Optional[str] = None


# Names and ids a client sends (models, response and item ids, call ids, keys): stored in indexed
# columns and echoed in errors, so bounded.
MAX_NAME_CHARS = 256


class MessageItem(_Tolerant):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    status: Optional[str] = None


class FunctionCallItem(_Tolerant):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str
    id: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    status: Optional[str] = None
    namespace: Optional[str] = None


class FunctionCallOutputItem(_Tolerant):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    output: Union[str, list[ContentPart]]
    id: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    status: Optional[str] = None


class ReasoningItem(_Tolerant):
    type: Literal["reasoning"]
    id: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    summary: list[ContentPart] = Field(default_factory=list)
    content: Optional[list[ContentPart]] = None
    encrypted_content: Optional[str] = None


class CompactionItem(_Tolerant):
    type: Literal["compaction"]
    id: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    encrypted_content: str


class ItemReference(_Tolerant):
    type: Literal["item_reference"]
    id: str = Field(max_length=MAX_NAME_CHARS)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "compaction", "item_reference",
              *MCP_ITEM_TYPES)


def _item_tag(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        t = value.get("type", "message")
    else:
        t = getattr(value, "type", "message")
    return t if t in ITEM_TYPES else None


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
        Annotated[CompactionItem, Tag("compaction")],
        Annotated[ItemReference, Tag("item_reference")],
        Annotated[McpListToolsItem, Tag("mcp_list_tools")], Annotated[McpCallItem, Tag("mcp_call")],
        Annotated[McpApprovalRequestItem, Tag("mcp_approval_request")],
        Annotated[McpApprovalResponseItem, Tag("mcp_approval_response")],
    ],
    Discriminator(_item_tag),
]


class TextFormat(_Tolerant):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Tolerant):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ReasoningConfig(_Tolerant):
    effort: Optional[str] = None
    summary: Optional[str] = None


TOOL_CHOICE_MODES = ("none", "auto", "required")
# Names and keys a client picks (model, ids, prompt_cache_key, user, x-session-id): each is
# echoed, stored or keys a table, so each is bounded (clients send ids and UUIDs; the openai
# clients clamp prompt_cache_key to 64).
_STREAM_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,256}$")


# `prompt_cache_options.ttl`: the minimum lifetimes OpenAI's API defines, in seconds.
PROMPT_CACHE_TTLS = {"30m": 1800.0, "12h": 43200.0}


class PromptCacheOptions(_Tolerant):
    """`prompt_cache_options` (openai 3.60): `ttl` is a minimum lifetime the client asks for
    (30m by default), `mode` says whether an implicit breakpoint is made, `prewarm` is a
    warm-up, `comparison_response_id` asks for `prompt_cache_diagnostics`."""

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m", "12h"] = "30m"
    prewarm: Optional[bool] = None
    comparison_response_id: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)


class ContextManagement(_Tolerant):
    """One `context_management` entry: `{type: "compaction", compact_threshold: N}` compacts inside
    the turn once its rendered prompt passes N tokens (other types are accepted and ignored)."""

    type: str
    compact_threshold: Optional[int] = Field(default=None, ge=1)


class ConversationRef(_Tolerant):
    """`conversation: {"id": ...}` (a bare id string is the same)."""

    id: str = Field(max_length=MAX_NAME_CHARS)


class ResponsesRequest(_Tolerant):
    """The body of `POST /v1/responses` (and the fields of WS `response.create`)."""

    model: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    input: Union[str, list[InputItem], None] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    # The conversation this response reads and appends to; exclusive with previous_response_id.
    conversation: Union[Annotated[str, Field(max_length=MAX_NAME_CHARS)], ConversationRef, None] = None
    store: Optional[bool] = True
    stream: Optional[bool] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = "auto"
    parallel_tool_calls: Optional[bool] = True
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    max_tool_calls: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    metadata: Optional[dict[str, str]] = None
    include: Optional[list[str]] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    prompt_cache_key: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    # {mode, ttl, prewarm, comparison_response_id}: `prewarm: true` is a warm-up (generate: false).
    prompt_cache_options: Optional[PromptCacheOptions] = None
    # OpenAI's schema: at most 64 characters.
    safety_identifier: Optional[str] = Field(default=None, max_length=64)
    service_tier: Optional[str] = Field(default=None, max_length=64)
    background: Optional[bool] = False
    generate: Optional[bool] = True
    context_management: Optional[list[ContextManagement]] = None
    user: Optional[str] = Field(default=None, max_length=MAX_NAME_CHARS)
    stream_id: Optional[str] = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("metadata may hold at most 16 pairs")
        for key, val in v.items():
            if len(key) > 64:
                raise ValueError("metadata keys are at most 64 characters")
            if len(val) > 512:
                raise ValueError("metadata values are at most 512 characters")
        return v

    @field_validator("stream_id")
    @classmethod
    def _stream_id_shape(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _STREAM_ID.match(v):
            raise ValueError("stream_id must be 1-256 characters of [A-Za-z0-9_.-]")
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools_named(cls, v: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
        for i, tool in enumerate(v or []):
            if not isinstance(tool.get("type"), str):
                raise ValueError(f"tools[{i}] needs a 'type'")
            if tool["type"] == "function" and not isinstance(tool.get("name"), str):
                raise ValueError(f"tools[{i}] (function) needs a 'name'")
            if tool["type"] == "function" and tool.get("parameters") is not None \
                    and not isinstance(tool["parameters"], dict):
                raise ValueError(f"tools[{i}].parameters must be a JSON schema object")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, v: Union[str, dict[str, Any], None]) -> Union[str, dict[str, Any], None]:
        if isinstance(v, str) and v not in TOOL_CHOICE_MODES:
            raise ValueError(f"'{v}' is not one of {', '.join(repr(m) for m in TOOL_CHOICE_MODES)}, or a tool object")
        if isinstance(v, dict):
            kind = v.get("type")
            if not isinstance(kind, str):
                raise ValueError("a tool_choice object needs a 'type'")
            if kind in ("function", "custom") and not isinstance(v.get("name"), str):
                raise ValueError(f"a tool_choice of type '{kind}' needs a 'name'")
            if kind == "allowed_tools" and (v.get("mode") not in ("auto", "required")
                                            or not isinstance(v.get("tools"), list)):
                raise ValueError("allowed_tools needs 'mode' ('auto' or 'required') and a 'tools' list")
        return v

    @property
    def conversation_id(self) -> Optional[str]:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation or None

    @property
    def is_warm_up(self) -> bool:
        """`generate: false`, or `prompt_cache_options.prewarm`: prefill and cache, no output."""
        prewarm = self.prompt_cache_options is not None and self.prompt_cache_options.prewarm is True
        return self.generate is False or prewarm

    @property
    def compact_threshold(self) -> Optional[int]:
        """The prompt size (tokens) past which the turn compacts its context, if asked."""
        for entry in self.context_management or []:
            if entry.type == "compaction" and entry.compact_threshold is not None:
                return entry.compact_threshold
        return None

    def input_items(self) -> list[dict[str, Any]]:
        """The new input as plain dicts; a string input is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_none=True, by_alias=True) for item in self.input]


def session_header(headers: Any) -> Optional[str]:
    """`x-session-id`, bounded like the other names a client picks."""
    value = headers.get("x-session-id")
    if value is not None and len(value) > MAX_NAME_CHARS:
        raise ApiError(400, f"Invalid 'x-session-id': string too long. Expected a string with maximum length "
                            f"{MAX_NAME_CHARS}, but got a string with length {len(value)} instead.",
                       param="x-session-id", code="string_above_max_length")
    return value or None


def parse_request(body: Any, *, max_input_items: Optional[int] = None, depth_checked: bool = False) -> ResponsesRequest:
    """Validate a decoded JSON body; every failure is a 400 `ApiError`. `depth_checked`: the
    caller bounded its nesting already (a WebSocket frame is, as it is parsed)."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    too_deep = None if depth_checked else json_depth_error(body)
    if too_deep is not None:
        raise too_deep
    items = body.get("input")
    if max_input_items is not None and isinstance(items, list) and len(items) > max_input_items:
        raise ApiError(
            400,
            f"Invalid 'input': array too long. Expected an array with maximum length {max_input_items}, "
            f"but got an array with length {len(items)} instead.",
            param="input",
            code="array_above_max_length",
        )
    bad_item = unknown_item_type_error(body) or echo_error(body)
    if bad_item is not None:
        raise bad_item
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    if req.conversation_id and req.previous_response_id:
        raise ApiError(400, "Mutually exclusive parameters: Ensure you are only providing one of: "
                            "'previous_response_id' or 'conversation'.", param="conversation",
                       code="mutually_exclusive_parameters")
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        names = {t.get("name") for t in req.tools or [] if t.get("type") == "function"}
        names |= {n.get("name") for t in req.tools or [] if t.get("type") == "namespace"
                  for n in (t.get("tools") or t.get("functions") or []) if isinstance(n, dict)}
        if choice["name"] not in names:
            raise ApiError(400, f"Tool choice '{choice['name']}' not found in 'tools' parameter.",
                           param="tool_choice", code="invalid_value")
    return req


def unknown_item_type_error(body: Any) -> Optional[ApiError]:
    """A clear error for an input item whose `type` we do not know."""
    if isinstance(body, dict) and isinstance(body.get("input"), list):
        for i, item in enumerate(body["input"]):
            if isinstance(item, dict) and "type" in item and item["type"] not in ITEM_TYPES:
                return ApiError(
                    400,
                    f"Invalid value: '{item['type']}'. Supported input item types are: {', '.join(ITEM_TYPES)}.",
                    param=f"input[{i}].type",
                    code="invalid_value",
                )
            if not isinstance(item, dict):
                return ApiError(400, "Each input item must be a JSON object.", param=f"input[{i}]", code="invalid_type")
    return None


MULTI_AGENT_BETA = "responses_multi_agent=v1"  # the `OpenAI-Beta` value a multi-agent socket sends


def multi_agent_enabled(body: dict[str, Any]) -> bool:
    value = body.get("multi_agent")
    return isinstance(value, dict) and value.get("enabled") is True


def admit_create(body: dict[str, Any], *, transport: Literal["http", "websocket"],
                 admit: Optional[Callable[[], None]], max_input_items: Optional[int],
                 betas: frozenset[str] = frozenset(), depth_checked: bool = False,
                 floor: Optional[Callable[[Any], None]] = None) -> ResponsesRequest:
    """The request, or the ApiError that refuses it. `floor`: a check of the body as it came (the
    context's token floor), run before the validation it can spare."""
    if admit is not None:
        admit()  # the key's rate limit: every create counts, valid or not
    if floor is not None:
        floor(body)
    req = parse_request(body, max_input_items=max_input_items, depth_checked=depth_checked)
    multi_agent = multi_agent_enabled(body)
    if transport == "http":
        if multi_agent:  # nothing could inject the outputs a multi-agent response would wait for
            raise ApiError(400, "multi_agent responses run in WebSocket mode (tool outputs come back with "
                                "response.inject).", param="multi_agent", code="unsupported_value")
        if req.background and req.stream:
            raise ApiError(400, "background responses cannot be streamed here; poll GET /v1/responses/{id}.",
                           param="stream", code="unsupported_value")
    else:
        if multi_agent and MULTI_AGENT_BETA not in betas:
            raise ApiError(400, f"multi_agent needs the 'OpenAI-Beta: {MULTI_AGENT_BETA}' header on the WebSocket "
                                "upgrade.", param="multi_agent", code="invalid_value")
        if req.background:
            raise ApiError(400, "background is not supported in websocket mode.", param="background",
                           code="invalid_value")
    return req
