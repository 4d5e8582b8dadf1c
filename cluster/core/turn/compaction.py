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

from typing import Any, Sequence

from cluster.core.render.renderer import COMPACTION_SUMMARY, content_text

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
