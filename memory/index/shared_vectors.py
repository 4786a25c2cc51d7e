"""The vector index as the engine uses it: every write tells the other replicas, and a search
first asks whether they wrote.

Each replica searches in-memory copies of users' vectors (index/vector_cache.py), kept in
step with its own writes only. So a write of a user's vectors bumps the user's vector
generation in the database (memory.storage.versions) right after Chroma took it, and a
recall reads the generations of the users it searches (one indexed read, while the query is
embedded) and drops the copies older than that. After the write, never before: a replica
that read the new generation and loaded a copy before the vectors existed would keep that
copy as current. With embedded Chroma the one process is the only writer and the check
never drops a copy; it stays, as one code path, for the price of that read.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from memory.index.vectors import Metadata, VectorIndex
from memory.storage import versions
from memory.storage.database import Database

SEEN_KEPT = 4096  # users whose generation last given to the index is remembered


@dataclass(eq=False)
class SharedVectors:
    """A VectorIndex whose writes bump, and whose searches check, vector generations."""

    db: Database
    index: VectorIndex
    # The generation last given to the index per user: an unchanged one needs no call,
    # which would wait for the index's lock behind any write in progress.
    _seen: OrderedDict[str, int] = field(default_factory=OrderedDict, init=False)

    async def add(
        self, ids: Sequence[str], vectors: npt.NDArray[np.float32], metadatas: Sequence[Metadata]
    ) -> None:
        """Insert or replace vectors by id, then count the write (and, for the recall cache,
        which sessions' own turns it added)."""
        owners = await asyncio.to_thread(self.index.add, ids, vectors, metadatas)
        turns = {(str(m["user_id"]), str(m["session_id"])) for m in metadatas
                 if m.get("source") == "turn"}
        await self._bump(owners, turns)

    async def delete(
        self, *, ids: Sequence[str] | None = None, where: Mapping[str, str] | None = None
    ) -> None:
        """Delete vectors by id and/or metadata equality, then count the write."""
        await self._bump(await asyncio.to_thread(self.index.delete, ids=ids, where=where))

    async def refresh(self, user_ids: Sequence[str]) -> None:
        """Before searching these users: drop their copies that another replica's writes
        made stale."""
        generations = await versions.vector_generations(self.db, user_ids)
        changed = {u: g for u, g in generations.items() if self._seen.get(u) != g}
        if not changed:
            return
        await asyncio.to_thread(self.index.refresh, changed)
        for user_id, generation in changed.items():
            self._seen[user_id] = generation
            self._seen.move_to_end(user_id)
        while len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)

    async def query(
        self, vector: npt.NDArray[np.float32], *, k: int, where: Mapping[str, str | bool]
    ) -> list[tuple[str, float]]:
        """Up to `k` (id, cosine similarity) pairs matching `where`, best first."""
        return await asyncio.to_thread(self.index.query, vector, k=k, where=where)

    async def _bump(
        self, user_ids: set[str], sessions: Collection[tuple[str, str]] = ()
    ) -> None:
        if not user_ids:
            return
        async with self.db.autocommit() as tx:
            bumped = await versions.bump_vectors(tx, user_ids, sessions)
        await asyncio.to_thread(self.index.advance, bumped)
