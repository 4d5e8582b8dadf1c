"""Responses items as the chat messages a template renders, and an item's content as text.

One assistant turn is one message: an assistant message and the function calls that follow it
(and the reasoning before them) are how the model produced them, so the render matches the tokens
the engine already holds. Read by the renderer, the safety gate (what a classifier reads) and
compaction (what a summary is made of).

Control tokens (`ContentGuard`: role forgery). A chat template renders message content,
tool outputs, instructions, reasoning and tool schemas as text, and the tokenizer then splits every added token (`<|im_start|>`, `<|im_end|>`,
`<tool_call>`, ...) out of that text wherever it occurs: a tool output holding
`<|im_end|><|im_start|>system ...` becomes a real system turn. That is vLLM's and HF's default;
OpenAI's API tokenizes content as text. This does the same on every template, on the full and
the delta render alike:

- Before the template runs, each string of the messages and tools that holds an added token's
  text (or one of the two marker characters below) has each such occurrence replaced by a
  marker, `\\ue000<n>\\ue001` (characters of Unicode's private use area), n naming the string.
- The rendered text is encoded piece by piece around the markers: the template's own text as
  before (its markers become their tokens), and each marked string as plain text: its first
  character and its rest encoded apart, so the tokenizer never sees it whole.

Strings without such text are passed as they are (the common case costs one regex search per
string); the encoding of a prompt without markers is the tokenizer's, unchanged.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator, Sequence

from cluster.protocol.request_bounds import json_depth_error

Message = dict[str, Any]


def content_text(content: Any, image_text: str = "[image]") -> str:
    """A content field as text. `image_text`: what an image stands as (a vision model's placeholder)."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(part.get("text") or "")
        elif kind == "refusal":
            parts.append(part.get("refusal") or "")
        elif kind == "input_image":
            parts.append(image_text)
        elif kind == "input_file":
            parts.append(f"[file {part.get('filename') or part.get('file_id') or ''}]".replace(" ]", "]"))
    return "".join(parts)


# A compaction item's opened summary (cluster/core/turn/context.py opens the sealed blob before a
# turn resolves): server-side only, never listed back to a client.
COMPACTION_SUMMARY = "_summary"


def compaction_text(item: dict[str, Any]) -> str:
    """A compaction item as the text the model sees: its summary, as one system message."""
    return "Summary of the earlier conversation:\n" + str(item.get(COMPACTION_SUMMARY, ""))


def content_parts(items: Sequence[dict[str, Any]]) -> Iterator[tuple[int, str, int, dict[str, Any]]]:
    """(item index, field, part index, part) of every content part, in the order the renderer
    renders them (messages' content, then tool outputs' output, item by item)."""
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        field = "content" if kind == "message" else "output" if kind == "function_call_output" else None
        parts = item.get(field) if field else None
        if not isinstance(parts, list):
            continue
        for j, part in enumerate(parts):
            if isinstance(part, dict):
                yield i, field, j, part


def _arguments(raw: str) -> Any:
    """A call's arguments as the template wants them: parsed when they are JSON, else as sent (a
    client's nesting deeper than a request may nest is text too: a template's `tojson` would
    overflow a few frames past what the parser takes, a 500)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    return raw if json_depth_error(value) is not None else value


def messages_from_items(items: Sequence[dict[str, Any]], image_text: str = "[image]",
                        raw_arguments: bool = False) -> tuple[list[Message], list[int]]:
    """Responses items -> chat messages, plus the item index where each message starts.

    An assistant message and the function calls that follow it form one
    assistant turn (that is how the model produced them, so the render matches
    the tokens the engine already holds in its prefix cache).
    """
    messages: list[Message] = []
    starts: list[int] = []
    reasoning = ""  # a reasoning item's text, for the assistant message it precedes
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            if role == "developer":
                role = "system"
            messages.append({"role": role, "content": content_text(item.get("content"), image_text)})
            if role == "assistant" and reasoning:
                _attach_reasoning(messages[-1], reasoning)
            reasoning = ""
            starts.append(i)
        elif kind == "reasoning":
            # Templates decide what earlier reasoning they show (Qwen3: only the current turn's).
            reasoning = content_text(item.get("content")) or content_text(item.get("summary"))
            continue
        elif kind == "function_call" or kind == "mcp_approval_request" or (kind == "mcp_call" and not
                                                                           item.get("approval_request_id")):
            # A server-run MCP call is the model's tool call (its id the call's id) and, once it
            # ran, the tool's answer; an approval request is the call the model made, unanswered.
            call = {
                "type": "function",
                "id": item["call_id"] if kind == "function_call" else item["id"],
                "function": {"name": item["name"], "arguments": (item.get("arguments") or "{}") if raw_arguments
                             else _arguments(item.get("arguments") or "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and _is_assistant_run(items, starts[-1], i):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                starts.append(i)
            if reasoning:
                _attach_reasoning(messages[-1], reasoning)
            reasoning = ""
            if kind == "mcp_call" and _ran(item):
                messages.append({"role": "tool", "tool_call_id": item["id"], "content": mcp_result(item)})
                starts.append(i)
        elif kind == "mcp_call" or (kind == "mcp_approval_response" and not item.get("approve")):
            # An approved call's result, or a refusal: the answer to the approval request's call.
            content = mcp_result(item) if kind == "mcp_call" else "The user did not approve this call."
            messages.append({"role": "tool", "tool_call_id": item["approval_request_id"], "content": content})
            starts.append(i)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"],
                 "content": content_text(item.get("output"), image_text)}
            )
            starts.append(i)
        elif kind == "compaction":
            messages.append({"role": "system", "content": compaction_text(item)})
            starts.append(i)
    return messages, starts


def _ran(item: dict[str, Any]) -> bool:
    return item.get("output") is not None or bool(item.get("error"))


def mcp_result(item: dict[str, Any]) -> str:
    """An MCP call's answer as the model reads it: its output, or its error."""
    if item.get("output") is not None:
        return str(item["output"])
    error = item.get("error")
    if isinstance(error, dict):  # OpenAI's typed errors: a message, or the tool's own content
        error = error.get("message") or content_text(error.get("content")) or json.dumps(error)
    return f"Error: {error or 'no result'}"


# The chat role each item type becomes in `messages_from_items` (a message: its own role).
_ITEM_ROLES = {"reasoning": "assistant", "function_call": "assistant", "function_call_output": "tool",
               "compaction": "system", "mcp_approval_request": "assistant"}


def item_roles(items: Sequence[dict[str, Any]]) -> frozenset[str]:
    """The chat roles `items` become, without building their messages."""
    roles = set()
    for item in items:
        kind = item.get("type", "message")
        role = item.get("role") if kind == "message" else _ITEM_ROLES.get(kind)
        if kind == "mcp_call":  # the model's call (unless approved before), and its answer once it ran
            if not item.get("approval_request_id"):
                roles.add("assistant")
            if item.get("approval_request_id") or _ran(item):
                roles.add("tool")
        elif kind == "mcp_approval_response" and not item.get("approve"):
            roles.add("tool")
        if role is not None:
            roles.add("system" if role == "developer" else role)
    return frozenset(roles)


def _attach_reasoning(message: Message, text: str) -> None:
    # Both names templates read (Qwen3: reasoning_content; others: reasoning).
    message["reasoning_content"] = message["reasoning"] = text


def _is_assistant_run(items: Sequence[dict[str, Any]], start: int, end: int) -> bool:
    for item in items[start:end]:
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue
        if kind in ("function_call", "mcp_approval_request", "mcp_list_tools"):
            continue
        if kind == "mcp_call" and not item.get("approval_request_id") and not _ran(item):
            continue
        if kind == "message" and item.get("role") == "assistant":
            continue
        return False
    return True


def message_kind(message: Message) -> str:
    role = message["role"]
    if role != "assistant":
        return role
    return "assistant" + ("+calls" if message.get("tool_calls") else "") + ("+think" if message.get("reasoning") else "")


OPEN, CLOSE = "\ue000", "\ue001"
_MARKED = re.compile(f"{OPEN}(\\d+){CLOSE}")


class ContentGuard:
    """Escapes added tokens' text in what a client sent, and encodes a render around the marks."""

    def __init__(self, added_tokens: Sequence[str], encode: Callable[[str], list[int]]) -> None:
        # Longest first: an added token that starts with another is matched whole.
        self.protected = sorted({t for t in added_tokens if t} | {OPEN, CLOSE}, key=len, reverse=True)
        self._index = {text: n for n, text in enumerate(self.protected)}
        self._find = self._finder(self.protected)
        self._finders: dict[str, re.Pattern] = {"": self._find}
        self._encode = encode
        self._plain: dict[int, list[int]] = {}

    @staticmethod
    def _finder(texts: Sequence[str]) -> re.Pattern:
        starts = "".join(sorted({re.escape(t[0]) for t in texts}))
        return re.compile(f"(?=[{starts}])(?:{'|'.join(re.escape(t) for t in texts)})")

    def escape(self, value: Any, keep: str = "") -> Any:
        """`value` (messages, tools: dicts, lists and strings) with every protected string marked
        but `keep` (a placeholder the renderer wrote itself: a vision model's image token); the
        same object when nothing in it is."""
        find = self._finders.get(keep)
        if find is None:
            find = self._finders[keep] = self._finder([t for t in self.protected if t != keep])
        return self._escape(value, find)

    def _escape(self, value: Any, find: re.Pattern) -> Any:
        if isinstance(value, str):
            return find.sub(self._mark, value) if find.search(value) else value
        if isinstance(value, dict):
            out = {k: self._escape(v, find) for k, v in value.items()}
            return value if all(out[k] is value[k] for k in value) else out
        if isinstance(value, list):
            items = [self._escape(v, find) for v in value]
            return value if all(a is b for a, b in zip(items, value)) else items
        return value

    def _mark(self, match: re.Match) -> str:
        return f"{OPEN}{self._index[match.group(0)]}{CLOSE}"

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt: a marked string as plain text, never its added token."""
        if OPEN not in text:
            return self._encode(text)
        ids: list[int] = []
        at = 0
        for match in _MARKED.finditer(text):
            if match.start() > at:
                ids += self._encode(text[at:match.start()])
            ids += self.plain(int(match.group(1)))
            at = match.end()
        if at < len(text):
            ids += self._encode(text[at:])
        return ids

    def plain(self, n: int) -> list[int]:
        """A protected string's ids as text: split so that no piece holds a protected string."""
        ids = self._plain.get(n)
        if ids is None:
            ids, rest = [], self.protected[n]
            while rest:
                cut = 1 if self._find.search(rest) else len(rest)  # its rest may be a token of its own
                ids += self._encode(rest[:cut])
                rest = rest[cut:]
            self._plain[n] = ids
        return ids


def delta_steps(system: bool, tools: bool, reuse: bool, messages: Sequence[Message]) -> tuple:
    """What decides whether a delta render can be exact: each step from one message to the
    next (anchor first, by kind), whether a system prompt and tools are rendered, and (first
    step) whether generated tokens are reused. The probe proves steps, not whole sequences,
    so a turn bringing any mix of proven steps takes the delta path."""
    kinds = [message_kind(m) for m in messages]
    return tuple((system, tools, reuse and i == 0, a, b) for i, (a, b) in enumerate(zip(kinds, kinds[1:])))
