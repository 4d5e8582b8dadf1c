"""The last prompt of each session an engine replica ran: a continuation sends only its tail.

A follow-up turn's prompt starts with the previous turn's prompt (the delta
render appends to the cached prefix), so the connection sends the new tokens
and names the base (`EngineRequest.base_request_id`, `base_len`); the replica
rebuilds the whole prompt here. Bounded by tokens (LRU); a miss (evicted,
another replica, another tenant's salt) answers `prompt_base_missing` and the
caller resends the whole prompt.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Optional

from ..core.messages import EngineRequest


class SessionPrompts:
    def __init__(self, max_tokens: int = 16_000_000) -> None:
        self.max_tokens = max_tokens
        # (cache salt, session key) -> (request id, prompt): one entry per session, LRU.
        self._last: OrderedDict[tuple, tuple[str, array]] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def resolve(self, req: EngineRequest) -> Optional[EngineRequest]:
        """The request with its whole prompt, or None when its base is not here."""
        if not req.is_tail:
            return req
        entry = self._last.get((req.cache_salt, req.session_key))
        if entry is None or entry[0] != req.base_request_id or len(entry[1]) < req.base_len:
            self.misses += 1
            return None
        self.hits += 1
        return req.with_prompt(entry[1][: req.base_len] + req.prompt_token_ids)

    def remember(self, req: EngineRequest) -> None:
        """Keep a (resolved) request's prompt as its session's base."""
        key = (req.cache_salt, req.session_key)
        old = self._last.pop(key, None)
        if old is not None:
            self._tokens -= len(old[1])
        self._last[key] = (req.request_id, req.prompt_token_ids)
        self._tokens += len(req.prompt_token_ids)
        while len(self._last) > 1 and self._tokens > self.max_tokens:
            _, (_, dropped) = self._last.popitem(last=False)
            self._tokens -= len(dropped)

    def __len__(self) -> int:
        return len(self._last)

    @property
    def tokens(self) -> int:
        return self._tokens
