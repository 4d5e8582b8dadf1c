"""API keys, tenants and per-key limits: admitted here, on this replica's counts plus what the
other connection replicas hold (`cluster/auth/limits.py`, when the app shares limits)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cluster.config import ApiKey, AuthConfig
from cluster.protocol.errors import ApiError
from cluster.auth.limits import LimitReports

log = logging.getLogger("loopserve.auth")


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str  # a short, non-secret id (hash prefix) for logs and limits
    max_connections: int
    requests_per_minute: int
    reads_per_minute: int = 1_000_000_000
    read_bytes_per_minute: int = 1 << 62
    input_bytes_per_minute: int = 1 << 62


ANONYMOUS = Principal("default", "anonymous", 1_000_000, 1_000_000_000)


class SlidingWindow:
    """What a key was admitted in a sliding minute, summed as it comes and goes (no walk per
    admission): requests (each weighs 1) or bytes. One entry per admission."""

    def __init__(self) -> None:
        self._entries: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, weight: int, now: float) -> None:
        self._entries.append((now, weight))
        self._total += weight

    def total(self, now: float) -> int:
        while self._entries and self._entries[0][0] <= now - 60.0:
            self._total -= self._entries.popleft()[1]
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def retry_after(self, now: float) -> float:
        return max(0.0, 60.0 - (now - self._entries[0][0])) if self._entries else 1.0


KEYS_FILE_CHECK_S = 5.0  # how often `auth.keys_file` is looked at for a change


class Authenticator:
    """Keys from the config and `auth.keys_file`. The file is read again when it changes (looked
    at every KEYS_FILE_CHECK_S): a revoked key stops working within seconds, on sockets already
    open too (their next create), without a restart."""

    def __init__(self, config: AuthConfig) -> None:
        self._config = config
        self._file = Path(config.keys_file) if config.keys_file else None
        self._file_seen: Optional[tuple[int, int]] = self._stamp()
        self._checked_at = time.monotonic()
        self._load(config.resolved())  # raises KeysMissing at start, never on a reload
        # Per key: "<key_id>" creates, "/read" reads, "/input_bytes" and "/read_bytes" what its
        # creates brought and its reads sent.
        self._windows: dict[str, SlidingWindow] = {}
        self._connections: dict[str, int] = {}
        self.shared = LimitReports()  # what other replicas hold (empty when limits are not shared)

    def _load(self, resolved: AuthConfig) -> None:
        self._keys: list[tuple[bytes, ApiKey]] = [(bytes.fromhex(k.sha256), k) for k in resolved.keys]
        self._admin: list[bytes] = [bytes.fromhex(d) for d in resolved.admin_keys]
        self._key_ids = frozenset(k.sha256[:12] for k in resolved.keys)

    def _stamp(self) -> Optional[tuple[int, int]]:
        try:
            st = self._file.stat() if self._file is not None else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st is not None else None

    def refresh(self, now: Optional[float] = None) -> None:
        """Read `keys_file` again if it changed (a bad or missing file keeps the keys in force)."""
        now = time.monotonic() if now is None else now
        if self._file is None or now - self._checked_at < KEYS_FILE_CHECK_S:
            return
        self._checked_at = now
        stamp = self._stamp()
        if stamp is None or stamp == self._file_seen:
            return
        try:
            resolved = self._config.resolved()
            if self._keys and not resolved.keys:  # a server with keys never turns keyless (open) on a reload
                raise ValueError("it holds no key")
            self._load(resolved)
        except Exception as exc:  # noqa: BLE001 - a half-written Secret: keep what works, say so
            log.warning("auth.keys_file %s changed but was not loaded (%s); the previous keys stay in force",
                        self._file, exc)
            return
        self._file_seen = stamp
        log.info("auth.keys_file %s reloaded: %d keys", self._file, len(self._keys))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: Optional[str]) -> Principal:
        self.refresh()
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
                         match.reads_per_minute, match.read_bytes_per_minute, match.input_bytes_per_minute)

    def authenticate_admin(self, authorization: Optional[str]) -> None:
        """Operational routes: an admin key, or 403 when the server has none configured."""
        if not self._admin:
            raise ApiError(403, "Operational routes are closed: this server has no admin key "
                                "(set auth.admin_keys).", code="admin_key_required", type="permission_error")
        digest = _bearer_digest(authorization)
        if not any([hmac.compare_digest(digest, expected) for expected in self._admin]):  # no early exit
            raise ApiError(401, "Incorrect admin key provided.", code="invalid_api_key", type="invalid_request_error")

    def admit_request(self, p: Principal, nbytes: int = 0, now: Optional[float] = None) -> None:
        """A create (or a request that renders like one) of `nbytes` (its body or frame, as far as
        known before it is read): sliding one-minute windows per key of creates and of their
        bytes; 429 past either. A key revoked since its socket opened is refused (401)."""
        self.refresh()
        if self._keys and p is not ANONYMOUS and p.key_id not in self._key_ids:
            raise ApiError(401, "This API key has been revoked.", code="invalid_api_key", type="invalid_request_error")
        now = time.monotonic() if now is None else now
        self._check(p.key_id + "/input_bytes", p.input_bytes_per_minute, "input bytes sent", now, adding=nbytes)
        self._check(p.key_id, p.requests_per_minute, "requests", now)
        self._add(p.key_id, 1, now)
        self.charge_input(p, nbytes, now)

    def admit_bytes(self, p: Principal, nbytes: int, now: Optional[float] = None) -> None:
        """Bytes a client sent outside a create (a WebSocket frame of any type, charged before it is
        read): the key's input-bytes window alone; 429 past it."""
        now = time.monotonic() if now is None else now
        self._check(p.key_id + "/input_bytes", p.input_bytes_per_minute, "input bytes sent", now, adding=nbytes)
        self.charge_input(p, nbytes, now)

    def charge_input(self, p: Principal, nbytes: int, now: Optional[float] = None) -> None:
        """Bytes of an admitted create learnt only as its body was read (chunked)."""
        if p is not ANONYMOUS and nbytes:
            now = time.monotonic() if now is None else now
            self._add(p.key_id + "/input_bytes", nbytes, now)

    def _add(self, window_key: str, weight: int, now: float) -> None:
        self._windows.setdefault(window_key, SlidingWindow()).add(weight, now)

    def _check(self, window_key: str, limit: int, what: str, now: float, adding: int = 1) -> None:
        """429 when the window (here and on other replicas), with `adding` more, passes `limit`.
        `adding` 1 refuses once the budget is spent; a request whose bytes alone pass the whole
        limit is let through an empty window (it could never pass otherwise)."""
        window = self._windows.get(window_key) or SlidingWindow()
        total = window.total(now) + self.shared.count(window_key)
        if total and total + adding > limit:
            retry = window.retry_after(now)  # 1 s when the rest were admitted on other replicas
            raise ApiError(429, f"Rate limit reached: {limit} {what} per minute. Try again in {retry:.1f}s.",
                           code="rate_limit_exceeded", type="rate_limit_exceeded", retry_after_s=retry)

    def admit_read(self, p: Principal, now: Optional[float] = None) -> None:
        """A read, delete or cancel: a window of its own, so polling does not eat the create budget;
        refused too while the key's reads of the last minute sent `read_bytes_per_minute`."""
        now = time.monotonic() if now is None else now
        self._check(p.key_id + "/read_bytes", p.read_bytes_per_minute, "bytes read", now)
        self._check(p.key_id + "/read", p.reads_per_minute, "reads", now)
        self._add(p.key_id + "/read", 1, now)

    def charge_read(self, p: Principal, nbytes: int, now: Optional[float] = None) -> None:
        """What an admitted read sent, against the key's `read_bytes_per_minute`."""
        if p is not ANONYMOUS:
            now = time.monotonic() if now is None else now
            self._add(p.key_id + "/read_bytes", nbytes, now)

    def open_connection(self, p: Principal) -> None:
        n = self._connections.get(p.key_id, 0)
        if n + self.shared.count(p.key_id + "/sockets") >= p.max_connections:
            raise ApiError(429, f"Too many concurrent connections for this key (limit {p.max_connections}).",
                           code="rate_limit_exceeded", type="rate_limit_exceeded")
        self._connections[p.key_id] = n + 1

    def close_connection(self, p: Principal) -> None:
        self._connections[p.key_id] = max(0, self._connections.get(p.key_id, 1) - 1)

    def entries(self) -> int:
        """The window entries this replica holds (one per admission of the last minute): its
        memory for limits, bounded by the keys' per-minute counts."""
        return sum(len(w) for w in self._windows.values())

    def held(self, now: Optional[float] = None) -> dict[str, int]:
        """What this replica holds per window (admissions in the last minute, open sockets): its
        report to the ledger. Empty windows are dropped here, so the tables stay as small as the
        keys in use."""
        now = time.monotonic() if now is None else now
        out = {}
        for key, window in list(self._windows.items()):
            total = window.total(now)
            if total:
                out[key] = total
            else:
                del self._windows[key]
        for key_id, n in list(self._connections.items()):
            if n:
                out[key_id + "/sockets"] = n
            else:
                del self._connections[key_id]
        return out


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
