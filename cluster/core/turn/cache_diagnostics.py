"""`prompt_cache_diagnostics`: why a turn's prompt did or did not reuse a compared response's.

A request naming `prompt_cache_options.comparison_response_id` gets, on its response, one of
OpenAI's four diagnostics (openai 3.60 `PromptCacheDiagnostics`):
- `comparison_response_not_found`: no such response for this key;
- `cache_miss` with the first difference that breaks prefix reuse, in the API's order (model,
  prompt_cache_key, tools, text format, reasoning effort, verbosity, compaction, input, service
  tier), `cache_missed_tokens` (the prompt's tokens after the divergence) and
  `comparison_reusable_tokens` (the compared prompt's tokens before it);
- `cache_hit`: nothing differs and the engine reused the prefix;
- `unavailable`: nothing differs, yet the engine did not reuse the prefix (its KV was evicted:
  the API has no reason for that), or the server cannot tell.
A continuation whose items are unchanged but whose prompt leaves the compared prompt before its
end (the chat template re-rendered an earlier message: rendered in full) is `input_changed`.

The request-side comparison (`compare`) runs before the engine; the verdict (`diagnostics`) needs
the engine's cached-token count, so it is made when the turn ends. Plain logic.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cluster.core.render.tokenizer import common_prefix  # noqa: F401 - used here and by its tests
from cluster.core.turn.cache import ResponseState

# Fields of an item that reach the prompt (ids and statuses do not).
_PROMPT_FIELDS = ("type", "role", "content", "call_id", "name", "arguments", "output", "summary", "encrypted_content")


@dataclass(frozen=True)
class CacheCheck:
    """The request's comparison with `comparison_response_id`, before the engine ran."""

    comparison_id: str
    found: bool
    reason: Optional[str] = None  # the first difference that breaks prefix reuse
    comparison_tokens: Optional[array] = None  # the compared response's rendered context, when cached


def _prompt_key(item: dict[str, Any]) -> str:
    return json.dumps([item.get(k) for k in _PROMPT_FIELDS], sort_keys=True, default=str)


def _response_field(state: ResponseState, *path: str) -> Any:
    value: Any = state.response or {}
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def compare(request: Any, model: str, items: Sequence[dict[str, Any]], comparison: Optional[ResponseState],
            comparison_id: str) -> CacheCheck:
    """The first difference between this request (its resolved context `items`) and the compared
    response that breaks prefix reuse, in the order OpenAI's API lists its reasons."""
    if comparison is None:
        return CacheCheck(comparison_id, False)
    text = request.text
    fmt = text.format.model_dump(by_alias=True, exclude_none=True) if text is not None and text.format else {"type": "text"}
    effort = request.reasoning.effort if request.reasoning is not None else None
    checks = (
        ("model_changed", model != comparison.model),
        ("prompt_cache_key_changed", request.prompt_cache_key != _response_field(comparison, "prompt_cache_key")),
        ("tools_changed", _canon(request.tools or []) != _canon(comparison.tools or [])),
        ("text_format_changed", _canon(fmt) != _canon(_response_field(comparison, "text", "format") or {"type": "text"})),
        ("reasoning_effort_changed", effort != _response_field(comparison, "reasoning", "effort")),
        ("verbosity_changed", (text.verbosity if text is not None else None)
         not in (None, _response_field(comparison, "text", "verbosity"))),
    )
    for reason, differs in checks:
        if differs:
            return CacheCheck(comparison_id, True, reason, _tokens(comparison))
    reason = _context_difference(request, items, comparison)
    if reason is None and (request.service_tier or "default") != (_response_field(comparison, "service_tier") or "default"):
        reason = "service_tier_changed"
    return CacheCheck(comparison_id, True, reason, _tokens(comparison))


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _tokens(state: ResponseState) -> Optional[array]:
    return state.rendered.token_ids if state.rendered is not None else None


def _context_difference(request: Any, items: Sequence[dict[str, Any]], comparison: ResponseState) -> Optional[str]:
    """`context_compacted` or `input_changed` where the compared context is not a prefix of this
    one (instructions are the prompt's start: a change there is an input change too)."""
    if (request.instructions or None) != (comparison.instructions or None):
        return "input_changed"
    before = comparison.items
    for i, old in enumerate(before):
        if i >= len(items) or _prompt_key(items[i]) != _prompt_key(old):
            rest = items[i:]
            if any(item.get("type") == "compaction" for item in rest):
                return "context_compacted"
            return "input_changed"
    return None


def diagnostics(check: CacheCheck, prompt_ids: Optional[Sequence[int]], prompt_tokens: int,
                cached_tokens: int, block_size: int = 1) -> dict[str, Any]:
    """The response's `prompt_cache_diagnostics` once the engine reported its cached tokens."""
    if not check.found:
        return {"type": "comparison_response_not_found"}
    if check.comparison_tokens is not None and prompt_ids is not None:
        reusable = common_prefix(check.comparison_tokens, prompt_ids)
    else:
        reusable = cached_tokens  # the engine's own count is the best estimate left
    reason = check.reason
    if reason is None and check.comparison_tokens is not None and prompt_ids is not None \
            and reusable < len(check.comparison_tokens):
        # The items continue the compared context, yet the prompt leaves its prompt before its end: the
        # chat template rendered an earlier message differently once newer ones came (a content- or
        # position-dependent template, which this turn therefore rendered in full). The rendered input
        # changed: the API's reason for that.
        reason = "input_changed"
    if reason is not None:
        return {"type": "cache_miss", "reason": reason, "cache_missed_tokens": max(0, prompt_tokens - reusable),
                "comparison_reusable_tokens": reusable}
    # Nothing differs: the engine reused what it kept (in whole blocks, the last token computed).
    if cached_tokens > 0 and cached_tokens + max(1, block_size) >= min(reusable, prompt_tokens):
        return {"type": "cache_hit"}
    return {"type": "unavailable"}
