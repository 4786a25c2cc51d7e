"""Rebuilding the vector index from the database, whose rows every vector is derived from.

The rebuild is a batch of ordinary, idempotent jobs: `index` for every turn (chunk, embed),
`sync_vectors` for the current facts, summaries and profiles. `memproxy backup` queues them in
its copy (admin/backup.py); the engine queues them when its collection is lost under it
(VectorRebuild below, told by index/vectors.py), and /readyz says so until they are done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from memory.index.vectors import VectorIndex
from memory.learning.fact_model import SYNC_JOB
from memory.storage import facts, jobs, profiles, summaries, turns
from memory.storage.database import Database

BATCH = 64  # items per rebuild job: one embedding batch each
log = logging.getLogger(f"memproxy.{__name__}")


async def queue_vector_rebuild(
    db: Database, *, index_job: str, turn_ids: Sequence[int] | None = None,
    max_attempts: int = 5,
) -> list[int]:
    """Queue, in one transaction, the jobs that rebuild every vector; return their ids
    (consecutive). `turn_ids` are the turns to index again (default: all of them)."""
    turn_ids = await turns.all_ids(db) if turn_ids is None else turn_ids
    payloads: list[tuple[str, dict[str, Any]]] = [
        *((index_job, {"turn_ids": ids}) for ids in _batches(turn_ids)),
        *((SYNC_JOB, {"facts": ids}) for ids in _batches(await facts.current_ids(db))),
        *((SYNC_JOB, {"summaries": ids}) for ids in _batches(await summaries.current_ids(db))),
        *((SYNC_JOB, {"profiles": ids}) for ids in _batches(await profiles.user_ids(db))),
    ]
    async with db.write() as tx:
        return [await jobs.enqueue(tx, kind, payload, max_attempts=max_attempts)
                for kind, payload in payloads]


class VectorRebuild:
    """Rebuilds the engine's vectors when the collection is lost, and reports the progress."""

    def __init__(
        self, db: Database, vectors: VectorIndex, *, index_job: str, max_attempts: int,
        notify: Callable[[], None],
    ) -> None:
        self.db = db
        self.index_job = index_job
        self.max_attempts = max_attempts
        self.notify = notify
        self.reason: str | None = None  # why the last rebuild began, while it runs
        self.jobs: tuple[int, int] | None = None  # its first and last job ids, once queued
        self._loop = asyncio.get_running_loop()
        self._queueing: set[asyncio.Task[None]] = set()
        vectors.on_lost = self._lost

    async def fill_if_new(self, vectors: VectorIndex) -> None:
        """Rebuild an empty collection beside another one when the database holds indexed
        turns: each embedding model has a collection of its own, so a change of model starts
        with an empty one. (A backup's copy starts with no collection and its own rebuild.)"""
        if await asyncio.to_thread(vectors.count) != 0:
            return
        others = await asyncio.to_thread(vectors.other_collections)
        if others and await turns.chunked_turn_ids(self.db):
            self.reason = f"collection {vectors.name} is new but turns were indexed"
            log.warning("%s: indexing them again from the database", self.reason)
            await self._queue()

    def _lost(self, reason: str) -> None:
        # Called in the thread that found the loss: the rest happens on the loop.
        self._loop.call_soon_threadsafe(self._begin, reason)

    def _begin(self, reason: str) -> None:
        log.warning("vector collection lost (%s): created again; rebuilding it from the"
                    " database", reason)
        self.reason = reason
        task = self._loop.create_task(self._queue())
        self._queueing.add(task)
        task.add_done_callback(self._queueing.discard)

    async def _queue(self) -> None:
        ids = await queue_vector_rebuild(
            self.db, index_job=self.index_job, max_attempts=self.max_attempts
        )
        if ids:  # after a loss during a rebuild, both batches count
            self.jobs = (min(ids[0], self.jobs[0]) if self.jobs else ids[0], ids[-1])
        log.info("queued %d job(s) to rebuild the vector index", len(ids))
        self.notify()

    async def progress(self) -> str | None:
        """What /readyz says while a rebuild runs ("rebuilding: ..."); None once it is done."""
        if self.reason is None:
            return None
        if self._queueing:
            return f"rebuilding: {self.reason}; queueing the jobs"
        left = await jobs.pending_between(self.db, *self.jobs) if self.jobs else 0
        if not left:
            self.reason = self.jobs = None
            return None
        return f"rebuilding: {self.reason}; {left} job(s) left"

    async def close(self) -> None:
        """Stop queueing (what was committed stays queued for the next start)."""
        for task in list(self._queueing):
            task.cancel()
        await asyncio.gather(*self._queueing, return_exceptions=True)


def _batches(items: Sequence[Any]) -> list[list[Any]]:
    return [list(items[i : i + BATCH]) for i in range(0, len(items), BATCH)]
