"""Proxy keys in the database (docs/keys.md): made, listed, changed and revoked for the admin
API, looked up by their secret's digest for authentication.

A secret is `mp-<prefix>_<random>`: `prefix` is 8 hex digits shown in listings so a person can
tell keys apart, `random` is 256 bits from `secrets` (url-safe base64). The secret is
returned once, by `create`; the table keeps only its SHA-256 (memory.storage.api_keys).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from memory.storage import api_keys
from memory.storage.api_keys import CHANGEABLE, StoredKey
from memory.storage.interface import Connection, Database

SECRET_PREFIX = "mp-"
_PREFIX_HEX = 8
_RANDOM_BYTES = 32  # 256 bits
_ID_HEX = 16


class KeyNotFound(LookupError):
    """No stored key has this id."""


class KeyRevoked(Exception):
    """The key is revoked: it cannot change, nor be revoked again."""


def digest(secret: str) -> str:
    """The hex SHA-256 a secret is stored and looked up as."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> tuple[str, str]:
    """(prefix, secret) of a new key."""
    prefix = secrets.token_hex(_PREFIX_HEX // 2)
    return prefix, f"{SECRET_PREFIX}{prefix}_{secrets.token_urlsafe(_RANDOM_BYTES)}"


class KeyStore:
    """The keys of one database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(
        self, *, user_id: str | None, org_id: str | None = None, org_writer: bool = False,
        expires_at: float | None = None, rate_limit: int | None = None,
        token_quota: int | None = None, now: float | None = None,
    ) -> tuple[StoredKey, str]:
        """A new key and its secret (the only time the secret is seen)."""
        prefix, secret = new_secret()
        key = StoredKey(
            "key_" + secrets.token_hex(_ID_HEX // 2), digest(secret), SECRET_PREFIX + prefix,
            user_id, org_id, org_writer, expires_at, rate_limit, token_quota,
            time.time() if now is None else now, None, None,
        )
        async with self.db.write() as tx:
            await api_keys.insert(tx, key)
        return key, secret

    async def get(self, key_id: str) -> StoredKey:
        """One key; KeyNotFound."""
        return await _existing(self.db, key_id)

    async def all(self) -> list[StoredKey]:
        """Every key, revoked ones too, oldest first."""
        return await api_keys.every(self.db)

    async def find(self, secret_digest: str) -> StoredKey | None:
        """The key with this digest, revoked or expired or not (the caller judges)."""
        return await api_keys.by_digest(self.db, secret_digest)

    async def change(self, key_id: str, changes: Mapping[str, Any]) -> StoredKey:
        """Change some of expires_at, rate_limit, token_quota, org_writer; KeyNotFound,
        KeyRevoked."""
        if unknown := set(changes) - CHANGEABLE:
            raise ValueError(f"cannot change {sorted(unknown)}")
        async with self.db.write() as tx:
            found = await _existing(tx, key_id)
            if found.revoked_at is not None:
                raise KeyRevoked(f"key {key_id!r} is revoked and cannot change")
            if changes:
                await api_keys.change(tx, key_id, changes)
        return replace(found, **changes)

    async def revoke(self, key_id: str, now: float | None = None) -> StoredKey:
        """Revoke a key; KeyNotFound, KeyRevoked (revoking twice)."""
        at = time.time() if now is None else now
        async with self.db.write() as tx:
            found = await _existing(tx, key_id)
            if not await api_keys.revoke(tx, key_id, at):
                raise KeyRevoked(f"key {key_id!r} is already revoked")
        return replace(found, revoked_at=at)

    async def members(self, org_id: str, now: float | None = None) -> frozenset[str]:
        """The users live keys of `org_id` are bound to."""
        at = time.time() if now is None else now
        return frozenset(await api_keys.members(self.db, org_id, at))

    async def touch(self, used: Iterable[tuple[str, float]]) -> None:
        """Record last-used times, all in one write."""
        if rows := list(used):
            async with self.db.write() as tx:
                await api_keys.touch(tx, rows)


async def _existing(db: Connection, key_id: str) -> StoredKey:
    found = await api_keys.by_id(db, key_id)
    if found is None:
        raise KeyNotFound(f"no key with id {key_id!r}")
    return found
