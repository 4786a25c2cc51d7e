"""Table `api_keys`: proxy keys kept in the database (docs/keys.md), created and revoked
through the admin API (memory.admin.api_keys owns their behaviour).

A key's secret is never stored: only `digest`, the SHA-256 of the whole secret (the secret
holds 256 random bits, so a plain digest cannot be reversed or guessed). Revoking sets
`revoked_at`; rows are never deleted, so a revoked key stays listed with its times.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

from memory.storage.database import Connection, Row, Transaction, column, marks

# What PATCH may change (memory.admin.api_keys checks the values).
CHANGEABLE = frozenset({"expires_at", "rate_limit", "token_quota", "org_writer"})


@dataclass(frozen=True)
class StoredKey:
    """One row of `api_keys` (never the secret: its digest)."""

    id: str
    digest: str
    prefix: str
    user_id: str | None
    org_id: str | None
    org_writer: bool
    expires_at: float | None
    rate_limit: int | None
    token_quota: int | None
    created_at: float
    last_used_at: float | None
    revoked_at: float | None

    def __repr__(self) -> str:  # the digest is not secret, but it has no business in logs
        return f"StoredKey(id={self.id!r}, prefix={self.prefix!r}, user_id={self.user_id!r})"


_COLUMNS = ", ".join(f.name for f in fields(StoredKey))


def _key(row: Row) -> StoredKey:
    # Both backends return each column as its field's type (REAL and INTEGER affinity on
    # SQLite, memory/storage/schema.py), but the 0/1 flag.
    values = list(row)
    values[5] = bool(values[5])  # org_writer
    return StoredKey(*values)


async def insert(tx: Transaction, key: StoredKey) -> None:
    """Store a new key."""
    values = [int(v) if isinstance(v, bool) else v for v in astuple(key)]  # org_writer 0/1
    await tx.change(f"INSERT INTO api_keys ({_COLUMNS}) VALUES ({marks(len(values))})", values)


async def by_digest(conn: Connection, digest: str) -> StoredKey | None:
    """The key whose secret has this digest, revoked or not."""
    rows = await conn.fetch(f"SELECT {_COLUMNS} FROM api_keys WHERE digest = ?", (digest,))
    return _key(rows[0]) if rows else None


async def by_id(conn: Connection, key_id: str) -> StoredKey | None:
    """One key by its id."""
    rows = await conn.fetch(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", (key_id,))
    return _key(rows[0]) if rows else None


async def every(conn: Connection) -> list[StoredKey]:
    """Every key, oldest first."""
    rows = await conn.fetch(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, id")
    return [_key(row) for row in rows]


async def change(tx: Transaction, key_id: str, changes: Mapping[str, Any]) -> int:
    """Set some of CHANGEABLE on a key not revoked; how many rows changed (0 or 1)."""
    names = sorted(changes)
    if not names or not set(names) <= CHANGEABLE:
        raise ValueError(f"only {sorted(CHANGEABLE)} can change")
    values = [int(v) if isinstance(v, bool) else v for v in (changes[n] for n in names)]
    sets = ", ".join(f"{name} = ?" for name in names)
    return await tx.change(
        f"UPDATE api_keys SET {sets} WHERE id = ? AND revoked_at IS NULL", (*values, key_id)
    )


async def revoke(tx: Transaction, key_id: str, now: float) -> int:
    """Revoke a key not revoked yet; how many rows changed (0 or 1)."""
    return await tx.change(
        "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (now, key_id)
    )


async def touch(tx: Transaction, used: Iterable[tuple[str, float]]) -> None:
    """Record when keys were last used (never moving a time back)."""
    await tx.change_many(
        "UPDATE api_keys SET last_used_at = ? WHERE id = ?"
        " AND (last_used_at IS NULL OR last_used_at < ?)",
        [(at, key_id, at) for key_id, at in used],
    )


async def members(conn: Connection, org_id: str, now: float) -> Sequence[str]:
    """The users that live keys of `org_id` are bound to."""
    return await column(
        conn, str, "SELECT DISTINCT user_id FROM api_keys WHERE org_id = ? AND user_id IS NOT NULL"
        " AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)",
        (org_id, now),
    )
