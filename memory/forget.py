"""Forgetting: delete a whole user's or one session's memory inside one write transaction.

Rows go at once; their vectors follow by durable jobs queued in the same transaction
(`sync_vectors` for facts, summaries and the profile, `drop_chunk_vectors` for turn chunks),
and recall never uses a vector whose row is gone, so nothing forgotten is ever recalled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from memory.facts import queue_sync
from memory.store import Store, Transaction, take_request_metrics
from memory.vectors import VectorIndex

DROP_CHUNK_VECTORS_JOB = "drop_chunk_vectors"
_BATCH = 1000


async def forget_user(tx: Transaction, user_id: str) -> dict[str, int]:
    """Delete every turn, chunk, session, fact, summary and the profile of a user (the
    caller takes the request metrics: a clear keeps them to undo, see memory/clearing.py)."""
    chunk_ids = await _ids(tx, "DELETE FROM chunks WHERE user_id = ? RETURNING id", (user_id,))
    # One statement for all turns: parent links are checked at its end, when none is left.
    turns = await tx.change("DELETE FROM turns WHERE user_id = ?", (user_id,))
    sessions = await tx.change("DELETE FROM sessions WHERE user_id = ?", (user_id,))
    fact_ids = await _ids(tx, "DELETE FROM facts WHERE user_id = ? RETURNING id", (user_id,))
    summary_ids = await _ids(
        tx, "DELETE FROM summaries WHERE user_id = ? RETURNING id", (user_id,)
    )
    profile = await tx.change("DELETE FROM profiles WHERE user_id = ?", (user_id,))
    await queue_sync(tx, facts=fact_ids, summaries=summary_ids, profiles=[user_id])
    await drop_chunk_vectors_later(tx, chunk_ids)
    return {
        "turns": turns, "sessions": sessions, "chunks": len(chunk_ids),
        "fact_versions": len(fact_ids), "summaries": len(summary_ids), "profile": profile,
    }


async def forget_session(tx: Transaction, user_id: str, session_id: str) -> dict[str, int] | None:
    """Delete a session's turns, chunks, summaries, request metrics and the facts learned
    only from it.

    A fact counts as learned only from the session when every version of it names the
    session as its source and cites no turn outside it. None when the session is unknown.
    """
    scope = (user_id, session_id)
    turn_ids = set(await _ids(
        tx, "SELECT id FROM turns WHERE user_id = ? AND session_id = ?", scope
    ))
    known = await tx.execute(
        "SELECT 1 FROM sessions WHERE user_id = ? AND session_id = ?", scope
    )
    if not turn_ids and not known:
        return None
    fact_ids = await _facts_only_from(tx, user_id, session_id, turn_ids)
    chunk_ids = await _ids(
        tx, "DELETE FROM chunks WHERE user_id = ? AND session_id = ? RETURNING id", scope
    )
    turns = await tx.change("DELETE FROM turns WHERE user_id = ? AND session_id = ?", scope)
    await tx.change("DELETE FROM sessions WHERE user_id = ? AND session_id = ?", scope)
    summary_ids = await _ids(
        tx, "DELETE FROM summaries WHERE user_id = ? AND session_id = ? RETURNING id", scope
    )
    if fact_ids:
        await tx.change(
            "DELETE FROM facts WHERE user_id = ? AND id IN (SELECT value FROM json_each(?))",
            (user_id, json.dumps(fact_ids)),
        )
    metrics = await take_request_metrics(tx, user_id, session_id)
    await queue_sync(tx, facts=fact_ids, summaries=summary_ids)
    await drop_chunk_vectors_later(tx, chunk_ids)
    return {
        "turns": turns, "chunks": len(chunk_ids), "summaries": len(summary_ids),
        "fact_versions": len(fact_ids), "request_metrics": len(metrics),
    }


async def drop_chunk_vectors_later(tx: Transaction, chunk_ids: Sequence[int]) -> None:
    """Queue the removal of these chunks' vectors, committed with the transaction."""
    for start in range(0, len(chunk_ids), _BATCH * 10):
        await tx.enqueue(DROP_CHUNK_VECTORS_JOB, {"chunks": list(chunk_ids[start:start + _BATCH * 10])})


class ChunkVectorDropper:
    """The `drop_chunk_vectors` job: delete vectors of chunks that no longer exist."""

    def __init__(self, store: Store, vectors: VectorIndex) -> None:
        self.store = store
        self.vectors = vectors

    async def run(self, payload: dict[str, Any]) -> None:
        """Delete `c<id>` vectors of the listed chunks that are gone from the database."""
        ids = [int(i) for i in payload.get("chunks", ())]
        for start in range(0, len(ids), _BATCH):
            batch = ids[start:start + _BATCH]
            # SQLite may give a deleted chunk's id to a new chunk: that one keeps its vector.
            rows = await self.store.read(
                "SELECT id FROM chunks WHERE id IN (SELECT value FROM json_each(?))",
                (json.dumps(batch),),
            )
            alive = {int(row[0]) for row in rows}
            gone = [f"c{i}" for i in batch if i not in alive]
            if gone:
                await asyncio.to_thread(self.vectors.delete, ids=gone)


async def _facts_only_from(
    tx: Transaction, user_id: str, session_id: str, turn_ids: set[int]
) -> list[int]:
    rows = await tx.execute(
        "SELECT id, chain_id, source_session, source_turn_ids FROM facts WHERE user_id = ?"
        " AND chain_id IN (SELECT chain_id FROM facts WHERE user_id = ? AND source_session = ?)",
        (user_id, user_id, session_id),
    )
    chains: dict[int, list[int]] = {}
    tainted: set[int] = set()
    for fact_id, chain_id, source_session, cited in rows:
        chains.setdefault(int(chain_id), []).append(int(fact_id))
        if source_session != session_id or not set(json.loads(cited)) <= turn_ids:
            tainted.add(int(chain_id))
    return sorted(i for chain, ids in chains.items() if chain not in tainted for i in ids)


async def _ids(tx: Transaction, sql: str, params: Sequence[Any]) -> list[int]:
    return [int(row[0]) for row in await tx.execute(sql, params)]
