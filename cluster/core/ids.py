"""Object ids in OpenAI's style (`resp_...`, `msg_...`, `fc_...`, `call_...`)."""

import secrets


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"
