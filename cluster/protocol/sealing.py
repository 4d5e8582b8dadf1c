"""Sealed `encrypted_content`: what the server hands a client to carry and give back unread.

A compaction item's summary and, with `include: ["reasoning.encrypted_content"]`, a reasoning
item's text travel through the client as blobs only this cluster can open: AES-256-GCM
(authenticated encryption) under a key every replica of the cluster shares, named by a key id in
the blob so keys rotate (the `active` key seals; every listed key still opens). The associated
data binds a blob to what it is (compaction or reasoning) and to the tenant it was made for, so a
blob cannot be replayed as another kind of item or by another tenant. Anything that does not open
(altered bytes, an unknown key id, another cluster's key, another server's format) is a 400
naming the item; nothing of it reaches the model.

Format: `ls1.<key id>.<base64url(12-byte nonce || ciphertext || tag)>`.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
from typing import Any, Mapping, Optional

from cluster.protocol.errors import ApiError

PREFIX = "ls1"
KEY_BYTES = 32
NONCE_BYTES = 12
# Longest blob opened: a compaction summary or one reasoning item, well above either.
MAX_BLOB_CHARS = 4 * 1024 * 1024


def new_key() -> str:
    """A fresh key, as the config holds it (base64 of 32 random bytes)."""
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()


def decode_key(key_id: str, value: str) -> bytes:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"sealing key {key_id!r} is not base64") from None
    if len(raw) != KEY_BYTES:
        raise ValueError(f"sealing key {key_id!r} has {len(raw)} bytes; it must have {KEY_BYTES} "
                         "(make one with `python -c 'from cluster.protocol.sealing import new_key; print(new_key())'`)")
    return raw


def unopenable(param: str, item_id: Optional[str]) -> ApiError:
    named = f"item '{item_id}'" if item_id else param
    return ApiError(400, f"The encrypted content for {named} could not be verified: it was not sealed by this "
                         "server (altered, forged, made by another deployment, or sealed under a key it no "
                         "longer holds).", param=param, code="invalid_encrypted_content")


class Sealer:
    """Seals and opens `encrypted_content` under the cluster's keys (key id -> 32-byte key)."""

    def __init__(self, keys: Mapping[str, bytes], active: str) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if active not in keys:
            raise ValueError(f"the active sealing key {active!r} is not among the keys {sorted(keys)}")
        for key_id in keys:
            if not key_id or "." in key_id:
                raise ValueError(f"sealing key id {key_id!r}: non-empty, without '.'")
        self._aead = {key_id: AESGCM(key) for key_id, key in keys.items()}
        self.active = active

    @classmethod
    def from_text(cls, keys: Mapping[str, str], active: str) -> "Sealer":
        return cls({key_id: decode_key(key_id, value) for key_id, value in keys.items()}, active)

    @staticmethod
    def _aad(kind: str, tenant: Optional[str]) -> bytes:
        return f"loopserve/{kind}/v1\x00{tenant or ''}".encode()

    def seal(self, kind: str, payload: dict[str, Any], tenant: Optional[str]) -> str:
        nonce = os.urandom(NONCE_BYTES)
        data = json.dumps(payload, separators=(",", ":")).encode()
        sealed = self._aead[self.active].encrypt(nonce, data, self._aad(kind, tenant))
        return f"{PREFIX}.{self.active}.{base64.urlsafe_b64encode(nonce + sealed).decode().rstrip('=')}"

    def open(self, kind: str, blob: Any, tenant: Optional[str], *, param: str,
             item_id: Optional[str] = None) -> dict[str, Any]:
        """The payload `seal` was given, or a 400 (`invalid_encrypted_content`) naming the item."""
        from cryptography.exceptions import InvalidTag

        if not isinstance(blob, str) or len(blob) > MAX_BLOB_CHARS:
            raise unopenable(param, item_id)
        prefix, _, rest = blob.partition(".")
        key_id, _, body = rest.partition(".")
        aead = self._aead.get(key_id)
        if prefix != PREFIX or aead is None:
            raise unopenable(param, item_id)
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            data = aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], self._aad(kind, tenant))
            payload = json.loads(data)
        except (binascii.Error, ValueError, InvalidTag):
            raise unopenable(param, item_id) from None
        if not isinstance(payload, dict):
            raise unopenable(param, item_id)
        return payload
