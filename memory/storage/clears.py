"""Tables `clears` and `clear_records`: clear-all with an undo window (memory.admin.clearing).

The cleared memory is kept as export records until the window ends; only the undo token's
hash is stored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from memory.storage.database import Connection, Transaction, column


async def insert(
    tx: Transaction, clear_id: str, user_id: str, *, removed: Mapping[str, int],
    records: Sequence[str], created_at: float, expires_at: float,
) -> None:
    """Record a pending clear and keep its records (JSON texts, in order)."""
    await tx.change(
        "INSERT INTO clears (id, user_id, status, removed, created_at, expires_at)"
        " VALUES (?, ?, 'pending', ?, ?, ?)",
        (clear_id, user_id, json.dumps(dict(removed)), created_at, expires_at),
    )
    await tx.change_many(
        "INSERT INTO clear_records (clear_id, seq, record) VALUES (?, ?, ?)",
        [(clear_id, seq, record) for seq, record in enumerate(records)],
    )


async def get(conn: Connection, clear_id: str) -> tuple[str, str, float] | None:
    """(user_id, status, expires_at) of a clear, or None."""
    rows = await conn.fetch(
        "SELECT user_id, status, expires_at FROM clears WHERE id = ?", (clear_id,)
    )
    return (str(rows[0][0]), str(rows[0][1]), float(rows[0][2])) if rows else None


async def pending(conn: Connection, user_id: str, now: float) -> list[dict[str, Any]]:
    """The user's clears still inside their undo window, oldest first."""
    rows = await conn.fetch(
        "SELECT created_at, expires_at, removed FROM clears WHERE user_id = ?"
        " AND status = 'pending' AND expires_at > ? ORDER BY created_at",
        (user_id, now),
    )
    return [{"created_at": r[0], "expires_at": r[1], "removed": json.loads(r[2])} for r in rows]


async def records(conn: Connection, clear_id: str) -> list[str]:
    """The records a clear keeps, in order."""
    sql = "SELECT record FROM clear_records WHERE clear_id = ? ORDER BY seq"
    return await column(conn, str, sql, (clear_id,))


async def mark_undone(tx: Transaction, clear_id: str) -> None:
    """The user asked for the memory back."""
    await tx.change("UPDATE clears SET status = 'undone' WHERE id = ?", (clear_id,))


async def purge(tx: Transaction, clear_id: str, now: float) -> bool:
    """Settle a pending clear whose window has ended: its records go for good."""
    purged = await tx.change(
        "UPDATE clears SET status = 'purged', settled_at = ? WHERE id = ?"
        " AND status = 'pending' AND expires_at <= ?",
        (now, clear_id, now),
    )
    if purged:
        await tx.change("DELETE FROM clear_records WHERE clear_id = ?", (clear_id,))
    return purged > 0


async def mark_restored(tx: Transaction, clear_id: str, now: float) -> None:
    """The records were imported again: the clear is settled and they go."""
    await tx.change(
        "UPDATE clears SET status = 'restored', settled_at = ? WHERE id = ?", (now, clear_id)
    )
    await tx.change("DELETE FROM clear_records WHERE clear_id = ?", (clear_id,))
