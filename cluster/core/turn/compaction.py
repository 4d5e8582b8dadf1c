"""Compaction as OpenAI shapes it: a context window becomes the user messages, verbatim, plus
exactly one `compaction` item that stands for everything else (assistant messages, tool calls and
their outputs, reasoning, earlier compactions), whenever there is anything else.

The summary inside the item is written by the served model (serving/responses.py runs the turn):
this module decides what is kept, and builds the summary request from the rest. The request is one
user message holding the conversation as a transcript, not the conversation itself: a history
that ends in an unanswered tool call, or holds roles a template refuses, still summarises, and the
transcript is cut (oldest first) to fit the model's context with room for the summary.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional, Sequence

from cluster.core.events import Event
from cluster.core.messages import TurnProgress
from cluster.core.render.chat_messages import COMPACTION_SUMMARY, content_text
from cluster.core.turn.cache import SessionCache
from cluster.core.turn.context import compaction_item
from cluster.core.turn.prepare import TurnSettings
from cluster.core.turn.turn import TurnRequest, TurnScope
from cluster.protocol.errors import ApiError, server_error
from cluster.protocol.ids import new_id
from cluster.protocol.requests import parse_request
from cluster.protocol.sealing import Sealer

# The summary's token budget (at most a quarter of the model's context).
SUMMARY_TOKENS = 512
# The driver's `run`: one turn's events.
RunPort = Callable[[TurnRequest], AsyncIterator[Event]]

INSTRUCTIONS = (
    "You compact the history of a conversation between a user and an AI assistant that uses tools, so the "
    "assistant can continue in a smaller context. Write a concise summary for the assistant: the task and its "
    "goals, decisions made, what tools were called and what they returned that still matters (file names, "
    "values, errors), what is done and what remains. Plain text, no preamble, do not address the user."
)
REQUEST = "Summarise this conversation so far; the user's messages are kept separately.\n\n<transcript>\n{}\n</transcript>"
# A cut transcript says so, so the summary does not claim the conversation began there.
CUT_MARK = "[... earlier part of the conversation omitted ...]\n"


def is_user_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


def needs_summary(items: Sequence[dict[str, Any]]) -> bool:
    """Whether a compaction item is due: there is something besides user messages."""
    return any(not is_user_message(item) for item in items)


def transcript_lines(items: Sequence[dict[str, Any]]) -> list[str]:
    """One line (or block) per item, in order: what the summary is written from."""
    lines = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            lines.append(f"[{item.get('role', 'user')}] {content_text(item.get('content'))}")
        elif kind == "function_call":
            lines.append(f"[tool call {item.get('call_id', '')}] {item.get('name', '')}({item.get('arguments', '')})")
        elif kind == "function_call_output":
            lines.append(f"[tool output {item.get('call_id', '')}] {content_text(item.get('output'))}")
        elif kind == "reasoning":
            text = content_text(item.get("content")) or content_text(item.get("summary"))
            if text:
                lines.append(f"[assistant reasoning] {text}")
        elif kind == "compaction":
            lines.append(f"[summary of what came before] {item.get(COMPACTION_SUMMARY, '')}")
    return lines


def summary_request(items: Sequence[dict[str, Any]], max_chars: int) -> str:
    """The user message asking for the summary: the transcript, its newest `max_chars` when longer."""
    text = "\n".join(transcript_lines(items))
    if len(text) > max_chars:
        text = CUT_MARK + text[len(text) - max_chars :]
    return REQUEST.format(text)


def kept_messages(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The user messages, verbatim and in order: what a compacted window keeps besides the item."""
    return [item for item in items if is_user_message(item)]


def compacted_window(items: Sequence[dict[str, Any]], summary: str, sealer: Optional[Sealer],
                     tenant: Optional[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The window a compaction leaves (the user messages, then the compaction item opened, as a
    turn sees it) and the item as the client gets it (sealed only)."""
    if sealer is None:
        raise server_error("This server has no sealing key, so it cannot make compaction items.")
    item = compaction_item(summary, sealer, tenant)
    return kept_messages(items) + [{**item, COMPACTION_SUMMARY: summary}], item


async def summarise(run: RunPort, settings: TurnSettings, items: Sequence[dict[str, Any]], tenant: Optional[str],
                    summary_tokens: int = SUMMARY_TOKENS) -> tuple[str, dict[str, Any]]:
    """The served model's summary of `items`, and the usage of writing it: one turn (store: false)
    on a transcript cut to the model's context (about 3 characters a token to start, halved while
    the prompt does not fit). A summary cut by its token budget is kept as far as it goes."""
    budget = max(64, min(summary_tokens, settings.context_limit // 4))
    max_chars = max(256, (settings.context_limit - budget - 256) * 3)
    for _ in range(6):
        request = parse_request({"model": settings.model_name, "instructions": INSTRUCTIONS,
                                 "input": [{"role": "user", "content": summary_request(items, max_chars)}],
                                 "max_output_tokens": budget, "store": False})
        turn = TurnRequest(request, TurnScope(SessionCache(), session_key=f"compact:{new_id('cmp')}", owner=tenant))
        try:
            progress = TurnProgress()
            async for ev in run(turn):
                progress.observe(ev)
        except ApiError as err:
            if err.code != "context_length_exceeded" or max_chars <= 256:
                raise
            max_chars //= 2
            continue
        response = progress.final
        if response is None:  # the summary's stream ended without a terminal event (cancelled)
            raise server_error("The conversation could not be summarized.")
        reason = (response.get("incomplete_details") or {}).get("reason")
        if response["status"] == "completed" or reason == "max_output_tokens":
            text = "".join(content_text(item.get("content")) for item in response["output"]
                           if item.get("type") == "message")
            return text.strip(), response["usage"]
        if reason == "content_filter":
            raise ApiError(400, "The conversation's summary was stopped by the content filter.",
                           code="content_filter", param="input")
        raise server_error("The model failed while writing the compaction summary.")
    raise server_error("The conversation could not be cut to fit the model's context for its summary.")
