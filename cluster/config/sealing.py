"""`sealing`: the keys that seal `encrypted_content`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml
from pydantic import Field

from cluster.config.auth import KeysMissing
from cluster.config.base import StrictModel


class SealingConfig(StrictModel):
    """Keys that seal `encrypted_content` (compaction items; reasoning items under
    `include: ["reasoning.encrypted_content"]`): AES-256-GCM under a key every replica shares.

    With no key configured, `build_app` makes one for the deployment: every replica of that
    deployment shares it, and blobs handed out before a redeploy no longer open after it (a
    400 naming the item). Production configs set keys (or a mounted `keys_file`) so blobs
    survive restarts; to rotate, add a new key, make it `active`, and drop the old one once the
    blobs it sealed have aged out.
    """

    keys: dict[str, str] = Field(default_factory=dict)
    """Key id -> base64 of 32 random bytes (`python -c 'from cluster.protocol.sealing import new_key;
    print(new_key())'`)."""
    active: Optional[str] = None
    """The key id that seals new blobs; every listed key still opens. Default: the only key, if there is one."""
    keys_file: Optional[str] = None
    """A YAML file with `keys:` and `active:` in the same shape (a mounted Kubernetes Secret), read where the
    connection replicas start; its keys are added to the above, its `active` wins."""

    def resolved(self) -> tuple[dict[str, str], Optional[str]]:
        """The keys (with the file's) and the active key id; ({}, None) when none is configured."""
        keys, active = dict(self.keys), self.active
        if self.keys_file:
            try:
                data = yaml.safe_load(Path(self.keys_file).read_text()) or {}
            except OSError as exc:
                raise KeysMissing(f"sealing.keys_file {self.keys_file!r} cannot be read ({exc.strerror})") from None
            extra = SealingConfig.model_validate({k: v for k, v in data.items() if k in ("keys", "active")})
            keys.update(extra.keys)
            active = extra.active or active
        if active is None and len(keys) == 1:
            active = next(iter(keys))
        if keys and active not in keys:
            raise KeysMissing(f"sealing.active {active!r} names none of the sealing keys {sorted(keys)}")
        return keys, active

