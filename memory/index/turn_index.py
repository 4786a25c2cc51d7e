"""Index jobs: a stored turn becomes chunks, their vectors and their lexical postings."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from config import Settings
from memory.index.chunking import chunk_text
from memory.index.embeddings import Embed
from memory.index.heap_fill import release_free_heap
from memory.index.shared_vectors import SharedVectors
from memory.index.standing import STANDING, is_standing
from memory.log.turn_log import TurnLog
from memory.storage.turns import Turn
from memory.tokens import count_tokens, off_loop

CHUNK_COUNT_MODEL = "gpt-4"  # chunk caps are model-agnostic: cl100k_base
# Characters of turn text in one batch of index jobs past which the process hands the heap
# it freed back to the system once they are indexed (heap_fill.release_free_heap): a 2 MB
# message otherwise left 70 MB behind (docs/benchmarks.md, "Large messages"). A batch of
# ordinary chat turns, hundreds of characters each, stays under it.
RELEASE_OVER_CHARS = 64_000


@dataclass(eq=False)
class TurnIndexer:
    """The handlers of index jobs (one job, or a batch of them)."""

    settings: Settings
    log: TurnLog
    shared_vectors: SharedVectors
    embed: Embed
    # Index jobs embed one at a time, each on embedding_threads threads: measured on 2
    # cores, nearly as fast as two jobs of one thread each (27 vs 29 turns/s, the same CPU
    # per turn), while a query's embedding still gets both cores when they are free.
    _indexing: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def index_job(self, payload: dict[str, Any]) -> None:
        await self.index_jobs([payload])

    async def index_jobs(self, payloads: list[dict[str, Any]]) -> None:
        """Chunk the jobs' turns, embed every chunk in one call and add them in one write."""
        turn_ids = dict.fromkeys(i for payload in payloads for i in payload["turn_ids"])
        turns = await self.log.get_turns(list(turn_ids))
        size = sum(len(turn.content) for turn in turns)
        await self._index(turns)
        del turns  # the texts are freed before the heap is trimmed
        if size > RELEASE_OVER_CHARS:
            await asyncio.to_thread(release_free_heap)

    async def _index(self, turns: Sequence[Turn]) -> None:
        ids: list[str] = []
        texts: list[str] = []
        metas: list[dict[str, str | int | float | bool]] = []
        for turn in turns:
            chunks = await off_loop(len(turn.content), functools.partial(
                chunk_text, turn.content, max_tokens=self.settings.chunk_max_tokens,
                count=lambda t: count_tokens(t, CHUNK_COUNT_MODEL),
                max_chunks=self.settings.index_max_chunks_per_turn,
            ))
            chunk_ids = await self.log.add_chunks(
                turn.id, [(c.ordinal, c.kind, c.text, c.tokens) for c in chunks]
            )
            speaker = turn.name or turn.role
            own = turn.role == "user" and not turn.name  # the user's own turn (standing.py)
            for chunk, chunk_id in zip(chunks, chunk_ids, strict=True):
                ids.append(f"c{chunk_id}")
                texts.append(f"{speaker}: {chunk.text}")
                metas.append({
                    "user_id": turn.user_id, "session_id": turn.session_id,
                    "turn_id": turn.id, "source": "turn", "created_at": turn.created_at,
                    **({STANDING: True} if own and is_standing(chunk.text) else {}),
                })
        if ids:
            async with self._indexing:
                vectors = await self.embed(texts)
            await self.shared_vectors.add(ids, vectors, metas)
