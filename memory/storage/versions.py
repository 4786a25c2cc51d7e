"""Tables `memory_versions` and `vector_generations`: counters of the writes to each user's
memory. The first is kept by triggers (migration 0006_injections); the second counts the
writes of the user's vectors to Chroma, bumped by memory.index.shared_vectors right after
each one. Both have a row per user with session '' that counts every write, and a row per
session that counts what was added to that session's own conversation (turns and chunks;
the vectors of its turns).

The vector generation (row '') is read before a search of the user's in-memory vector copy;
the recall cache (memory.recall.cache) is stamped with both.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from memory.storage.database import Connection, Transaction, in_values


async def stamp(conn: Connection, user_id: str, session_id: str) -> tuple[int, int]:
    """The user's writes, and writes of their vectors, each minus those added to
    `session_id`: unchanged while nothing but that session's own conversation was written."""
    rows = await conn.fetch(
        "SELECT 0, session_id, version FROM memory_versions"
        " WHERE user_id = ? AND session_id IN ('', ?)"
        " UNION ALL SELECT 1, session_id, generation FROM vector_generations"
        " WHERE user_id = ? AND session_id IN ('', ?)",
        (user_id, session_id, user_id, session_id),
    )
    # Row '' counts every write; a row of `session_id` (none when it is '') is subtracted.
    totals = [0, 0]
    for table, session, count in rows:
        totals[int(table)] += int(count) if session == "" else -int(count)
    return totals[0], totals[1]


async def vector_generations(conn: Connection, user_ids: Sequence[str]) -> dict[str, int]:
    """{user: generation of their vectors} (0 for a user whose vectors were never written)."""
    test, param = in_values(conn, user_ids)
    rows = await conn.fetch(
        "SELECT user_id, generation FROM vector_generations"
        f" WHERE session_id = '' AND user_id {test}",
        (param,),
    )
    return dict.fromkeys(user_ids, 0) | {str(row[0]): int(row[1]) for row in rows}


async def bump_vectors(
    tx: Transaction, user_ids: Collection[str], sessions: Collection[tuple[str, str]] = ()
) -> dict[str, int]:
    """Count one more write of these users' vectors, and of the (user, session) pairs'
    turn vectors; return the users' new generations."""
    bumped = {}
    for user_id, session_id in [*((u, "") for u in sorted(user_ids)), *sorted(sessions)]:
        rows = await tx.fetch(
            "INSERT INTO vector_generations (user_id, session_id, generation) VALUES (?, ?, 1)"
            " ON CONFLICT (user_id, session_id) DO UPDATE"
            " SET generation = vector_generations.generation + 1 RETURNING generation",
            (user_id, session_id),
        )
        if not session_id:
            bumped[user_id] = int(rows[0][0])
    return bumped
