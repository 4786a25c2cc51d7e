"""Table `usage_reservations`: tokens held by the running requests of keys with a quota.

A request of a quota key reserves an estimate of its tokens when it is admitted and gives
the reservation back when it ends (docs/usage.md, "Quotas"). Each row expires on its own
(`expires_at`): a replica that dies mid-request leaves a row that stops counting then.
"""

from __future__ import annotations

from memory.storage.database import Transaction, scalar


async def held(tx: Transaction, key_id: str, now: float) -> int:
    """The tokens `key_id`'s live reservations hold; expired rows (any key's) are deleted."""
    await tx.change("DELETE FROM usage_reservations WHERE expires_at <= ?", (now,))
    sql = "SELECT COALESCE(SUM(tokens), 0) FROM usage_reservations WHERE key_id = ?"
    return await scalar(tx, int, sql, (key_id,))


async def add(tx: Transaction, hold_id: str, key_id: str, tokens: int, expires_at: float) -> None:
    """Hold `tokens` for `key_id` until `expires_at` (unix seconds) or its removal."""
    await tx.change(
        "INSERT INTO usage_reservations (id, key_id, tokens, expires_at) VALUES (?, ?, ?, ?)",
        (hold_id, key_id, tokens, expires_at),
    )


async def remove(tx: Transaction, hold_id: str) -> bool:
    """Give a reservation back; False when it was gone (expired and swept)."""
    return await tx.change("DELETE FROM usage_reservations WHERE id = ?", (hold_id,)) > 0
