"""Forgetting: delete a whole user's or one session's memory inside one write transaction.

Rows go at once; their vectors follow by durable jobs queued in the same transaction
(`sync_vectors` for facts, summaries and the profile, `drop_chunk_vectors` for turn chunks),
and recall never uses a vector whose row is gone, so nothing forgotten is ever recalled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memory.index.shared_vectors import SharedVectors
from memory.learning.facts import queue_sync
from memory.storage import facts, jobs, metrics, profiles, sessions, summaries, turns
from memory.storage.database import Database, Transaction

DROP_CHUNK_VECTORS_JOB = "drop_chunk_vectors"
_BATCH = 1000


async def forget_user(tx: Transaction, user_id: str) -> dict[str, int]:
    """Delete every turn, chunk, session, fact, summary and the profile of a user (the
    caller takes the request metrics: a clear keeps them to undo, see clearing.py)."""
    chunk_ids = await turns.delete_chunks(tx, user_id)
    turn_count = await turns.delete(tx, user_id)
    session_count = await sessions.delete(tx, user_id)
    fact_ids = await facts.delete(tx, user_id)
    summary_ids = await summaries.delete(tx, user_id)
    profile = await profiles.delete(tx, user_id)
    await queue_sync(tx, facts=fact_ids, summaries=summary_ids, profiles=[user_id])
    await drop_chunk_vectors_later(tx, chunk_ids)
    return {
        "turns": turn_count, "sessions": session_count, "chunks": len(chunk_ids),
        "fact_versions": len(fact_ids), "summaries": len(summary_ids), "profile": profile,
    }


async def forget_session(tx: Transaction, user_id: str, session_id: str) -> dict[str, int] | None:
    """Delete a session's turns, chunks, summaries, request metrics and the facts learned
    only from it.

    A fact counts as learned only from the session when every version of it names the
    session as its source and cites no turn outside it. None when the session is unknown.
    """
    turn_ids = set(await turns.ids_of_session(tx, user_id, session_id))
    if not turn_ids and await sessions.get(tx, user_id, session_id) is None:
        return None
    fact_ids = await _facts_only_from(tx, user_id, session_id, turn_ids)
    chunk_ids = await turns.delete_chunks(tx, user_id, session_id)
    turn_count = await turns.delete(tx, user_id, session_id)
    await sessions.delete(tx, user_id, session_id)
    summary_ids = await summaries.delete(tx, user_id, session_id=session_id)
    if fact_ids:
        await facts.delete(tx, user_id, fact_ids)
    taken = await metrics.take_rows(tx, user_id, session_id)
    await queue_sync(tx, facts=fact_ids, summaries=summary_ids)
    await drop_chunk_vectors_later(tx, chunk_ids)
    return {
        "turns": turn_count, "chunks": len(chunk_ids), "summaries": len(summary_ids),
        "fact_versions": len(fact_ids), "request_metrics": len(taken),
    }


async def drop_chunk_vectors_later(tx: Transaction, chunk_ids: Sequence[int]) -> None:
    """Queue the removal of these chunks' vectors, committed with the transaction."""
    for start in range(0, len(chunk_ids), _BATCH * 10):
        await jobs.enqueue(
            tx, DROP_CHUNK_VECTORS_JOB, {"chunks": list(chunk_ids[start:start + _BATCH * 10])}
        )


async def drop_chunk_vectors(db: Database, vectors: SharedVectors, payload: dict[str, Any]) -> None:
    """The `drop_chunk_vectors` job: delete the `c<id>` vectors of the listed chunks that are
    gone from the database."""
    ids = [int(i) for i in payload.get("chunks", ())]
    for start in range(0, len(ids), _BATCH):
        batch = ids[start:start + _BATCH]
        # SQLite may give a deleted chunk's id to a new chunk: that one keeps its vector.
        alive = await turns.existing_chunks(db, batch)
        gone = [f"c{i}" for i in batch if i not in alive]
        if gone:
            await vectors.delete(ids=gone)


async def _facts_only_from(
    tx: Transaction, user_id: str, session_id: str, turn_ids: set[int]
) -> list[int]:
    versions = await facts.session_chains(tx, user_id, session_id)
    tainted = {chain for _, chain, source, cited in versions
               if source != session_id or not set(cited) <= turn_ids}
    return sorted(fact_id for fact_id, chain, _, _ in versions if chain not in tainted)
