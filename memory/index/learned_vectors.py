"""The `sync_vectors` job: make the vectors of facts, summaries and profiles match their rows.

Idempotent by design: it reads the rows as they are now, upserts the vectors of rows that
recall may use and deletes the others (deleted, superseded, or a profile without consent).
Vector ids: `f<fact id>`, `s<summary id>`, `p<user digits>`; metadata `source` says which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from memory.index.shared_vectors import SharedVectors
from memory.index.vectors import Metadata
from memory.learning.facts import Fact, facts_by_id
from memory.learning.profiles import ProfileStore, profile_vector_id
from memory.learning.summaries import summaries_by_id
from memory.storage.database import Database

Embed = Callable[[Sequence[str]], Awaitable[np.ndarray]]


class LearnedVectors:
    """Runs sync_vectors jobs against one vector index."""

    def __init__(
        self, db: Database, profiles: ProfileStore, vectors: SharedVectors, embed: Embed
    ) -> None:
        self.db = db
        self.profiles = profiles
        self.vectors = vectors
        self.embed = embed
        # Serialised: a job reads rows only once the previous one has written its vectors,
        # so an older job can never write back a state that a newer change removed.
        self._lock = asyncio.Lock()

    async def sync(self, payload: dict[str, Any]) -> None:
        """Upsert the vectors of usable rows named in `payload`, delete the rest."""
        async with self._lock:
            await self._sync(payload)

    async def _sync(self, payload: dict[str, Any]) -> None:
        keep: dict[str, tuple[str, Metadata]] = {}
        drop: list[str] = []
        fact_ids = [int(i) for i in payload.get("facts", ())]
        found = {f.id: f for f in await facts_by_id(self.db, fact_ids)}
        for fact_id in fact_ids:
            fact = found.get(fact_id)
            if fact is None or fact.valid_to is not None:
                drop.append(f"f{fact_id}")
                continue
            keep[f"f{fact_id}"] = (fact.text, fact_metadata(fact))
        summary_ids = [int(i) for i in payload.get("summaries", ())]
        summaries = {s.id: s for s in await summaries_by_id(self.db, summary_ids)}
        for summary_id in summary_ids:
            summary = summaries.get(summary_id)
            if summary is None or not summary.current:
                drop.append(f"s{summary_id}")
                continue
            keep[f"s{summary_id}"] = (summary.text, {
                "user_id": summary.user_id, "session_id": summary.session_id,
                "source": "summary", "turn_id": summary.last_turn_id,
                "created_at": summary.created_at,
            })
        for user_id in payload.get("profiles", ()):
            profile = await self.profiles.usable(str(user_id))
            if profile is None or not profile.render():
                drop.append(profile_vector_id(str(user_id)))
                continue
            keep[profile_vector_id(profile.user_id)] = (profile.render(), {
                "user_id": profile.user_id, "session_id": "", "source": "profile",
                "turn_id": 0, "created_at": profile.updated_at,
            })
        if drop:
            await self.vectors.delete(ids=drop)
        if keep:
            ids = list(keep)
            vectors = await self.embed([keep[i][0] for i in ids])
            await self.vectors.add(ids, vectors, [keep[i][1] for i in ids])


def fact_metadata(fact: Fact) -> Metadata:
    """The vector metadata of a fact."""
    return {
        "user_id": fact.user_id, "session_id": fact.source_session or "", "source": "fact",
        "category": fact.category, "turn_id": 0, "created_at": fact.last_seen,
    }
