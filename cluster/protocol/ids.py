"""Object ids in OpenAI's style (`resp_...`, `msg_...`, `fc_...`, `call_...`)."""

import hashlib
import secrets
from typing import Optional


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def session_key(named: Optional[str], tenant: Optional[str] = None) -> str:
    """The engine's key for the session a client named (`x-session-id`, `prompt_cache_key`, a
    previous response id), as a fixed-size digest: what a client sends never keys the tables
    of a replica (prompts, KV budget, routing) by itself. With its `tenant`: two tenants naming
    their sessions alike ("default", "my-app") never share a key, its routing or its waits.
    None: a new random session."""
    if not named:
        return secrets.token_hex(16)
    scoped = named if tenant is None else f"{tenant}\x00{named}"
    return hashlib.blake2b(scoped.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
