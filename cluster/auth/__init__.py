"""Who is calling and what they may do: API keys and tenants (`keys.py`), and the keys' limits
held for the whole app across connection replicas (`limits.py`)."""

from cluster.auth.keys import ANONYMOUS, KEYS_FILE_CHECK_S, Authenticator, Principal, SlidingWindow, key_sha256

__all__ = ["ANONYMOUS", "Authenticator", "KEYS_FILE_CHECK_S", "Principal", "SlidingWindow", "key_sha256"]
