"""API keys, tenants and per-key limits (in-process; per connection replica)."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from cluster.config import ApiKey, AuthConfig
from cluster.protocol.errors import ApiError


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str  # a short, non-secret id (hash prefix) for logs and limits
    max_connections: int
    requests_per_minute: int
    reads_per_minute: int = 1_000_000_000


ANONYMOUS = Principal("default", "anonymous", 1_000_000, 1_000_000_000)


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self._keys: list[tuple[bytes, ApiKey]] = [(bytes.fromhex(k.sha256), k) for k in config.keys]
        self._admin: list[bytes] = [bytes.fromhex(d) for d in config.admin_keys]
        self._windows: dict[str, deque[float]] = {}
        self._connections: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: Optional[str]) -> Principal:
        if not self._keys:
            return ANONYMOUS
        digest = _bearer_digest(authorization)
        match = None
        for expected, key in self._keys:  # constant time per key, no early exit
            if hmac.compare_digest(digest, expected):
                match = key
        if match is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key", type="invalid_request_error")
        return Principal(match.tenant, match.sha256[:12], match.max_connections, match.requests_per_minute,
                         match.reads_per_minute)

    def authenticate_admin(self, authorization: Optional[str]) -> None:
        """Operational routes: an admin key, or 403 when the server has none configured."""
        if not self._admin:
            raise ApiError(403, "Operational routes are closed: this server has no admin key "
                                "(set auth.admin_keys).", code="admin_key_required", type="permission_error")
        digest = _bearer_digest(authorization)
        if not any([hmac.compare_digest(digest, expected) for expected in self._admin]):  # no early exit
            raise ApiError(401, "Incorrect admin key provided.", code="invalid_api_key", type="invalid_request_error")

    def admit_request(self, p: Principal, now: Optional[float] = None) -> None:
        """A create (or a request that renders like one): sliding one-minute window per key; 429 past the limit."""
        self._admit(p.key_id, p.requests_per_minute, "requests", now)

    def admit_read(self, p: Principal, now: Optional[float] = None) -> None:
        """A read, delete or cancel: a window of its own, so polling does not eat the create budget."""
        self._admit(p.key_id + "/read", p.reads_per_minute, "reads", now)

    def _admit(self, window_key: str, limit: int, what: str, now: Optional[float]) -> None:
        now = time.monotonic() if now is None else now
        window = self._windows.setdefault(window_key, deque())
        while window and window[0] <= now - 60.0:
            window.popleft()
        if len(window) >= limit:
            retry = max(0.0, 60.0 - (now - window[0]))
            raise ApiError(429, f"Rate limit reached: {limit} {what} per minute. "
                                f"Try again in {retry:.1f}s.", code="rate_limit_exceeded", type="rate_limit_exceeded",
                           retry_after_s=retry)
        window.append(now)

    def open_connection(self, p: Principal) -> None:
        n = self._connections.get(p.key_id, 0)
        if n >= p.max_connections:
            raise ApiError(429, f"Too many concurrent connections for this key (limit {p.max_connections}).",
                           code="rate_limit_exceeded", type="rate_limit_exceeded")
        self._connections[p.key_id] = n + 1

    def close_connection(self, p: Principal) -> None:
        self._connections[p.key_id] = max(0, self._connections.get(p.key_id, 1) - 1)


def _bearer_digest(authorization: Optional[str]) -> bytes:
    token = ""
    if authorization and authorization[:7].lower() == "bearer ":
        token = authorization[7:].strip()
    if not token:
        raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="missing_api_key", type="invalid_request_error")
    return hashlib.sha256(token.encode()).digest()


def key_sha256(key: str) -> str:
    """What goes into `auth.keys[].sha256` for a key."""
    return hashlib.sha256(key.encode()).hexdigest()
