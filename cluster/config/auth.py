"""API keys, tenants and their limits."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import yaml
from pydantic import Field, field_validator

from cluster.config.base import StrictModel


class ApiKey(StrictModel):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 hex digest of the key: configs never hold keys in clear."""
    tenant: str
    """The tenant the key acts for: its responses, items and limits are its own."""
    max_connections: int = Field(64, ge=1)
    """WebSockets the tenant may hold open at once."""
    requests_per_minute: int = Field(600, ge=1)
    """Responses the tenant may create per minute."""
    input_bytes_per_minute: int = Field(48 * 1024 * 1024, ge=1024)
    """Request bytes the tenant may send per minute (HTTP create bodies, `input_tokens` and `compact`;
    every WebSocket frame, whatever its type), counted before the body is parsed: reading a body
    holds a replica's event loop by the byte. Calibrated on the worst shapes (`loopserve bench
    adversarial --shapes`): parsing and validating a create of 10,000 one-part messages is 45-64 ms
    a MiB here, json.loads of `[[],[],...]` up to the container bound 42-55; 48 MiB is then at most ~3 s of one
    replica's loop a minute per key (5%). That is ~12M tokens a minute: a stateless client
    resending a 128k-token history every turn fits ~90 turns a minute. A create larger than the
    limit is admitted when the minute is empty."""
    reads_per_minute: int = Field(3000, ge=1)
    """Reads and deletes the tenant may make per minute (GET a response or its input items, DELETE,
    cancel): a read of a response no longer in memory loads its chain from the store."""
    read_bytes_per_minute: int = Field(256 * 1024 * 1024, ge=1024)
    """Bytes of responses and input items the tenant may read per minute (GET, with or without
    `stream`): a read costs the server by what it sends (a response echoing 900 KB of tools is
    ~3 ms of JSON and a copy per GET), so a count alone lets one key hold the event loop with
    large reads. Charged when a read is answered; past it, reads get 429 until the minute frees
    room (one read may overshoot by its own size)."""


class AuthConfig(StrictModel):
    """Bearer keys; with none configured every request is the `default` tenant.

    `admin_keys` (sha256 hex digests) open the operational routes
    (`/loopserve/stats`, and `/loopserve/echo` when enabled); those routes show
    every tenant's response ids and usage, so with no admin key configured they
    are closed (403), whatever `keys` says.
    """

    keys: list[ApiKey] = Field(default_factory=list)
    """API keys (sha256 digests) and their tenants; none: every request is the `default` tenant."""
    admin_keys: list[str] = Field(default_factory=list)
    """sha256 hex digests of the keys that open `/loopserve/stats` and `/loopserve/echo`."""
    keys_file: Optional[str] = None
    """A YAML file with `keys:` and `admin_keys:` in the same shape, added to the above where the connection
    replicas start (a mounted Kubernetes Secret): keys change without a config change."""
    require_keys: bool = False
    """Refuse to start with no API key at all (every shipped config that binds beyond loopback sets it): anonymous
    access is the `default` tenant with no limits worth the name."""

    @field_validator("admin_keys")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        for digest in v:
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError("admin_keys holds sha256 hex digests of keys, never keys in clear")
        return v

    def resolved(self) -> "AuthConfig":
        """These keys plus the file's; raises `KeysMissing` when `require_keys` finds none."""
        keys, admin = list(self.keys), list(self.admin_keys)
        if self.keys_file:
            try:
                data = yaml.safe_load(Path(self.keys_file).read_text()) or {}
            except OSError as exc:
                raise KeysMissing(f"auth.keys_file {self.keys_file!r} cannot be read ({exc.strerror}); "
                                  "mount the keys Secret there or unset auth.keys_file") from None
            extra = AuthConfig.model_validate({k: v for k, v in data.items() if k in ("keys", "admin_keys")})
            keys += extra.keys
            admin += extra.admin_keys
        if self.require_keys and not keys:
            raise KeysMissing(
                "auth.require_keys is set but no API key is configured: add sha256 digests under auth.keys, "
                "or point auth.keys_file at a YAML file of them (`python -c \"from cluster.auth import "
                "key_sha256; print(key_sha256('sk-...'))\"` prints one)")
        return self.model_copy(update={"keys": keys, "admin_keys": admin, "keys_file": None})


class KeysMissing(ValueError):
    """The configuration asks for API keys and has none."""
