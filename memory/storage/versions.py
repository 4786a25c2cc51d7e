"""Table `memory_versions`: counters of the writes to each user's memory, kept by triggers
(migration 0006_injections), read by the recall cache (memory.recall.cache)."""

from __future__ import annotations

from memory.storage.database import Connection


async def stamp(conn: Connection, user_id: str, session_id: str) -> int:
    """The user's writes minus the turns and chunks added to `session_id`: unchanged while
    nothing but that session's own conversation was written."""
    rows = await conn.fetch(
        "SELECT session_id, version FROM memory_versions"
        " WHERE user_id = ? AND session_id IN ('', ?)",
        (user_id, session_id),
    )
    counts = {str(row[0]): int(row[1]) for row in rows}
    return counts.get("", 0) - (counts.get(session_id, 0) if session_id else 0)
