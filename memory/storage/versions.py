"""Tables `memory_versions` and `vector_generations`: counters of the writes to each user's
memory. The first is kept by triggers (migration 0006_injections) and read by the recall cache
(memory.recall.cache); the second counts the writes of the user's vectors to Chroma, bumped
by memory.index.shared_vectors right after each one, and read before a search of the user's
in-memory vector copy (and by the recall cache: a dense hit can appear with no other write).
"""

from __future__ import annotations

from collections.abc import Sequence

from memory.storage.database import Connection, Transaction, in_values


async def stamp(conn: Connection, user_id: str, session_id: str) -> tuple[int, int]:
    """The user's writes minus the turns and chunks added to `session_id` (unchanged while
    nothing but that session's own conversation was written), and the user's vector
    generation."""
    rows = await conn.fetch(
        "SELECT session_id, version FROM memory_versions"
        " WHERE user_id = ? AND session_id IN ('', ?)"
        " UNION ALL SELECT NULL, generation FROM vector_generations WHERE user_id = ?",
        (user_id, session_id, user_id),
    )
    counts = {row[0]: int(row[1]) for row in rows}
    writes = counts.get("", 0) - (counts.get(session_id, 0) if session_id else 0)
    return writes, counts.get(None, 0)


async def vector_generations(conn: Connection, user_ids: Sequence[str]) -> dict[str, int]:
    """{user: generation of their vectors} (0 for a user whose vectors were never written)."""
    test, param = in_values(conn, user_ids)
    rows = await conn.fetch(
        f"SELECT user_id, generation FROM vector_generations WHERE user_id {test}", (param,)
    )
    return dict.fromkeys(user_ids, 0) | {str(row[0]): int(row[1]) for row in rows}


async def bump_vectors(tx: Transaction, user_ids: Sequence[str]) -> dict[str, int]:
    """Count one more write of these users' vectors; return their new generations."""
    bumped = {}
    for user_id in user_ids:
        rows = await tx.fetch(
            "INSERT INTO vector_generations (user_id, generation) VALUES (?, 1)"
            " ON CONFLICT (user_id) DO UPDATE"
            " SET generation = vector_generations.generation + 1 RETURNING generation",
            (user_id,),
        )
        bumped[user_id] = int(rows[0][0])
    return bumped
