"""Tables `profiles` and `consent`: the user-authored profile and the consent that governs it
(memory.learning.profiles)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from memory.storage.database import Connection, Transaction, column


async def has_consent(conn: Connection, user_id: str) -> bool:
    """Whether the user's consent to a profile is on (default: no)."""
    sql = "SELECT 1 FROM consent WHERE user_id = ? AND profile = 1"
    return bool(await conn.fetch(sql, (user_id,)))


async def set_consent(tx: Transaction, user_id: str, on: bool, now: float) -> None:
    """Record consent given or revoked."""
    await tx.change(
        "INSERT INTO consent (user_id, profile, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT (user_id) DO UPDATE SET profile = excluded.profile,"
        " updated_at = excluded.updated_at",
        (user_id, int(on), now),
    )


async def get(conn: Connection, user_id: str) -> tuple[dict[str, Any], str, float, float] | None:
    """(fields, text, created_at, updated_at) of the user's profile, or None."""
    rows = await conn.fetch(
        "SELECT fields, text, created_at, updated_at FROM profiles WHERE user_id = ?",
        (user_id,),
    )
    if not rows:
        return None
    row = rows[0]
    return json.loads(row[0]), str(row[1]), float(row[2]), float(row[3])


async def put(
    tx: Transaction, user_id: str, fields: Mapping[str, Any], text: str, now: float
) -> None:
    """Write the whole profile (created now, or updated now)."""
    await tx.change(
        "INSERT INTO profiles (user_id, fields, text, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (user_id) DO UPDATE SET"
        " fields = excluded.fields, text = excluded.text, updated_at = excluded.updated_at",
        (user_id, json.dumps(dict(fields), ensure_ascii=False), text, now, now),
    )


async def delete(tx: Transaction, user_id: str) -> int:
    """Delete the user's profile; return how many rows went (0 or 1)."""
    return await tx.change("DELETE FROM profiles WHERE user_id = ?", (user_id,))


async def user_ids(conn: Connection) -> list[str]:
    """Every user with a profile, in order (backups rebuild from them)."""
    return await column(conn, str, "SELECT user_id FROM profiles ORDER BY user_id")
