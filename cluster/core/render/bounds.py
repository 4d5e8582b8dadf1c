"""What a prompt costs at least, known before the tokenizer runs.

A token covers at most `max_token_chars` characters (the tokenizer's longest vocabulary entry,
added tokens included), so text of n characters is at least n / max_token_chars tokens. The text
counted is what every chat template renders as it is: the content of user, system and developer
messages and the output of tool calls, each part stripped (templates may trim). An input whose
floor is over the model's context is refused without tokenizing it: tokenizing holds the GIL
(~0.65 s per MB here), so a client sending multi-megabyte inputs would otherwise stall the
replica's event loop (and its health checks) only to learn the same answer.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

# Normalizers that compose characters (NFC/NFKC) can turn several characters into one.
_COMPOSING_FACTOR = 4


def max_token_chars(tokenizer) -> Optional[int]:
    """The most characters of input one token of `tokenizer` can stand for (None: unknown, no floor)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # mistral_common, or a slow tokenizer: no vocabulary to read the bound from
        return None
    pre = repr(backend.pre_tokenizer)
    if "Whitespace" in pre or "Bert" in pre:  # whitespace is dropped, not tokenized
        return None
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=0)
    if longest <= 0:
        return None
    return longest * (_COMPOSING_FACTOR if backend.normalizer is not None else 1)


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value.strip())
    if isinstance(value, list):
        return sum(len(part["text"].strip()) for part in value
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def verbatim_chars(items: Sequence[dict[str, Any]]) -> int:
    """Characters of `items` every chat template renders as they are."""
    total = 0
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer"):
            total += _text_chars(item.get("content"))
        elif kind == "function_call_output":
            total += _text_chars(item.get("output"))
    return total


def kept_items(new_items: Sequence[dict[str, Any]], truncation: Optional[str]) -> Sequence[dict[str, Any]]:
    """The new items every prompt of the turn holds: all of them, or with `truncation: "auto"`
    (which drops whole user turns from the oldest, never the last) those from the last user message on."""
    if truncation != "auto":
        return new_items
    for i in range(len(new_items) - 1, -1, -1):
        item = new_items[i]
        if item.get("type", "message") == "message" and item.get("role") == "user":
            return new_items[i:]
    return new_items


def min_prompt_tokens(items: Sequence[dict[str, Any]], max_chars: Optional[int]) -> int:
    """A floor on the tokens `items` add to a prompt (0 when the tokenizer gives no bound)."""
    if not max_chars:
        return 0
    return verbatim_chars(items) // max_chars
