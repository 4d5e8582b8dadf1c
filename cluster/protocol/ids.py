"""Object ids in OpenAI's style (`resp_...`, `msg_...`, `fc_...`, `call_...`)."""

import hashlib
import secrets
from typing import Optional


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def session_key(named: Optional[str]) -> str:
    """The engine's key for the session a client named (`x-session-id`, `prompt_cache_key`, a
    previous response id), as a fixed-size digest: what a client sends never keys the tables
    of a replica (prompts, KV budget, routing) by itself. None: a new random session."""
    if not named:
        return secrets.token_hex(16)
    return hashlib.blake2b(named.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
