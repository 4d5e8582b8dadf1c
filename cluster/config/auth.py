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
