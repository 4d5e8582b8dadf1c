"""The last prompt of each session an engine replica ran: a continuation sends only its tail.

A follow-up turn's prompt starts with the previous turn's prompt (the delta
render appends to the cached prefix), so the connection sends the new tokens
and names the base (`EngineRequest.base_request_id`, `base_len`); the replica
rebuilds the whole prompt here. Bounded by the memory the entries take (LRU: each
prompt's 4 bytes a token plus what an entry costs Python, ~600 bytes); a miss (evicted,
another replica, another tenant's salt) answers `prompt_base_missing` and the
caller resends the whole prompt.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Optional

from cluster.core.messages import EngineRequest

ENTRY_BYTES = 600  # an entry's Python objects besides its tokens (key tuple, strings, array, dict node)


def _entry_nbytes(key: tuple, request_id: str, prompt: array) -> int:
    return ENTRY_BYTES + prompt.itemsize * len(prompt) + len(request_id) + sum(len(k or "") for k in key)


class SessionPrompts:
    def __init__(self, max_tokens: int = 16_000_000) -> None:
        # The bound is in bytes: `max_tokens` of prompts in 4-byte token ids, entries counted in full
        # (without it, 8-token prompts would hold ~1 GiB under a 16M-token bound).
        self.max_bytes = max_tokens * 4
        # (cache salt, session key) -> (request id, prompt): one entry per session, LRU.
        self._last: OrderedDict[tuple, tuple[str, array]] = OrderedDict()
        self._tokens = 0
        self.nbytes = 0
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
        prompt = entry[1][: req.base_len]  # a new array: the session's base is never changed
        prompt.extend(req.prompt_token_ids)  # (in place: one copy of the history a turn, not two)
        return req.with_prompt(prompt)

    def remember(self, req: EngineRequest) -> None:
        """Keep a (resolved) request's prompt as its session's base."""
        key = (req.cache_salt, req.session_key)
        old = self._last.pop(key, None)
        if old is not None:
            self._forget(key, old)
        self._last[key] = (req.request_id, req.prompt_token_ids)
        self._tokens += len(req.prompt_token_ids)
        self.nbytes += _entry_nbytes(key, req.request_id, req.prompt_token_ids)
        while len(self._last) > 1 and self.nbytes > self.max_bytes:
            self._forget(*self._last.popitem(last=False))

    def _forget(self, key: tuple, entry: tuple[str, array]) -> None:
        self._tokens -= len(entry[1])
        self.nbytes -= _entry_nbytes(key, *entry)

    def __len__(self) -> int:
        return len(self._last)

    @property
    def tokens(self) -> int:
        return self._tokens
