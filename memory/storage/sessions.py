"""Table `sessions`: one row per (user, session) with its times and turn count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory.storage.database import Connection, Transaction, equal_to, scalar

SessionKey = tuple[float, str]  # last_active, session_id: the listing's sort key


async def touch(
    tx: Transaction, user_id: str, session_id: str, times: Sequence[float], added: int
) -> None:
    """Record activity at `times` that added `added` turns (creating the row if needed)."""
    larger = "GREATEST" if tx.dialect == "postgres" else "MAX"
    await tx.change(
        "INSERT INTO sessions (user_id, session_id, created_at, last_active, turn_count)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (user_id, session_id) DO UPDATE SET"
        f" last_active = {larger}(sessions.last_active, excluded.last_active),"
        " turn_count = sessions.turn_count + excluded.turn_count",
        (user_id, session_id, min(times), max(times), added),
    )


async def page(
    conn: Connection, user_id: str, *, limit: int, before: SessionKey | None = None
) -> list[tuple[str, float, float]]:
    """(session_id, created_at, last_active) of up to `limit` sessions, most recently
    active first, starting after the session whose key is `before`."""
    where = "user_id = ?"
    params: list[Any] = [user_id]
    if before is not None:
        last_active, session_id = before
        where += " AND (last_active < ? OR (last_active = ? AND session_id < ?))"
        params += [last_active, last_active, session_id]
    rows = await conn.fetch(
        f"SELECT session_id, created_at, last_active FROM sessions WHERE {where}"
        " ORDER BY last_active DESC, session_id DESC LIMIT ?",
        (*params, limit),
    )
    return [(str(row[0]), float(row[1]), float(row[2])) for row in rows]


async def get(
    conn: Connection, user_id: str, session_id: str
) -> tuple[str, float, float] | None:
    """(session_id, created_at, last_active) of one session, or None."""
    rows = await conn.fetch(
        "SELECT session_id, created_at, last_active FROM sessions"
        " WHERE user_id = ? AND session_id = ?",
        (user_id, session_id),
    )
    return (str(rows[0][0]), float(rows[0][1]), float(rows[0][2])) if rows else None


async def count(conn: Connection, user_id: str) -> int:
    """How many sessions a user has."""
    sql = "SELECT COUNT(*) FROM sessions WHERE user_id = ?"
    return await scalar(conn, int, sql, (user_id,))


async def delete(tx: Transaction, user_id: str, session_id: str | None = None) -> int:
    """Delete a user's sessions (or one of them); return how many."""
    where, params = equal_to(user_id=user_id, session_id=session_id)
    return await tx.change(f"DELETE FROM sessions WHERE {where}", params)
