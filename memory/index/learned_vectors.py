"""The `sync_vectors` job: make the vectors of facts, summaries and profiles match their rows.

Idempotent by design: it reads the rows as they are now, upserts the vectors of rows that
recall may use and deletes the others (deleted, superseded, or a profile without consent).
Vector ids: `f<fact id>`, `s<summary id>`, `p<user digits>`; metadata `source` says which.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from memory.index.embeddings import Embed
from memory.index.shared_vectors import SharedVectors
from memory.index.vectors import Metadata
from memory.learning.profiles import ProfileStore, profile_vector_id
from memory.storage import facts, summaries
from memory.storage.database import Database
from memory.storage.facts import Fact


@dataclass(eq=False)
class LearnedVectors:
    """Runs sync_vectors jobs against one vector index."""

    db: Database
    profiles: ProfileStore
    vectors: SharedVectors
    embed: Embed
    # Serialised: a job reads rows only once the previous one has written its vectors,
    # so an older job can never write back a state that a newer change removed.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def sync(self, payload: dict[str, Any]) -> None:
        """Upsert the vectors of usable rows named in `payload`, delete the rest."""
        async with self._lock:
            await self._sync(payload)

    async def _sync(self, payload: dict[str, Any]) -> None:
        # Every vector named is dropped unless its row is usable (None: drop).
        wanted: dict[str, tuple[str, Metadata] | None] = {}
        fact_ids = [int(i) for i in payload.get("facts", ())]
        wanted.update((f"f{i}", None) for i in fact_ids)
        for fact in await facts.get_many(self.db, None, fact_ids):
            if fact.valid_to is None:
                wanted[f"f{fact.id}"] = (fact.text, fact_metadata(fact))
        summary_ids = [int(i) for i in payload.get("summaries", ())]
        wanted.update((f"s{i}", None) for i in summary_ids)
        for summary in await summaries.get_many(self.db, None, summary_ids):
            if summary.current:
                wanted[f"s{summary.id}"] = (summary.text, {
                    "user_id": summary.user_id, "session_id": summary.session_id,
                    "source": "summary", "turn_id": summary.last_turn_id,
                    "created_at": summary.created_at,
                })
        for user_id in map(str, payload.get("profiles", ())):
            profile = await self.profiles.usable(user_id)
            text = profile.render() if profile is not None else ""
            wanted[profile_vector_id(user_id)] = None if profile is None or not text else (text, {
                "user_id": user_id, "session_id": "", "source": "profile", "turn_id": 0,
                "created_at": profile.updated_at,
            })
        if drop := [id_ for id_, row in wanted.items() if row is None]:
            await self.vectors.delete(ids=drop)
        if keep := {id_: row for id_, row in wanted.items() if row is not None}:
            vectors = await self.embed([text for text, _ in keep.values()])
            await self.vectors.add(list(keep), vectors, [meta for _, meta in keep.values()])


def fact_metadata(fact: Fact) -> Metadata:
    """The vector metadata of a fact."""
    return {
        "user_id": fact.user_id, "session_id": fact.source_session or "", "source": "fact",
        "category": fact.category, "turn_id": 0, "created_at": fact.last_seen,
    }
