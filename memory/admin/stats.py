"""What one user's memory holds, how big the indexes are, and per-request metrics over time."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from memory.admin.sessions import CursorError
from memory.index.vectors import VectorIndex
from memory.jobs.queue import JobQueue
from memory.learning.facts import FactStore
from memory.learning.profiles import ProfileStore
from memory.storage import facts, metrics, sessions, summaries, turns
from memory.storage.database import Database

MAX_METRICS_ROWS = 10_000
DEAD_LETTERS_SHOWN = 20


@dataclass(eq=False)
class MemoryStats:
    """Counts, index sizes, queue depth and request metrics."""

    db: Database
    vectors: VectorIndex
    facts: FactStore
    profiles: ProfileStore
    _: KW_ONLY
    vectors_path: Path

    async def user(self, user_id: str) -> dict[str, Any]:
        """Counts of the user's memory, index sizes, and the (shared) job queue."""
        return {
            "user_id": user_id,
            "counts": await self._counts(user_id),
            "index": await self._index(user_id),
            "jobs": await self.jobs(),
        }

    async def jobs(self) -> dict[str, Any]:
        """Queue depth by status and the latest dead letters (their kind and error only)."""
        queue = JobQueue(self.db)
        counts = await queue.job_counts()
        dead = await queue.dead_jobs(DEAD_LETTERS_SHOWN)
        return {
            **counts,
            "depth": counts["queued"] + counts["running"],
            "dead_letters": [
                {"id": job.id, "kind": job.kind, "attempts": job.attempts,
                 "error": (job.last_error or "")[:500], "updated_at": job.updated_at}
                for job in dead
            ],
        }

    async def metrics(
        self, user_id: str, since: float, until: float, limit: int, cursor: str | None = None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of the user's per-request metrics rows in [since, until), oldest first,
        and the next page's cursor."""
        after = None if cursor is None else _decode(cursor)
        found = await metrics.page(self.db, user_id, since, until, limit + 1, after)
        rows = found[:limit]
        more = len(found) > limit
        return [row for _, row in rows], _encode(rows[-1][1]["created_at"], rows[-1][0]) if more else None

    async def metrics_summary(self, user_id: str, since: float, until: float) -> dict[str, Any]:
        """Count, recall latency percentiles and injected tokens of every row in the range,
        computed by the database."""
        totals = await metrics.totals(self.db, user_id, since, until)
        p50, p95 = [
            await metrics.latency_at(self.db, user_id, since, until, _rank(totals.latencies, pct))
            if totals.latencies else None
            for pct in (50, 95)
        ]
        mean = totals.injected_tokens_mean
        return {
            "requests": totals.requests,
            "recall_ms_p50": p50,
            "recall_ms_p95": p95,
            "recall_ms_max": totals.recall_ms_max,
            "injected_tokens_mean": None if mean is None else round(mean, 1),
            "injected_tokens_max": totals.injected_tokens_max,
            "truncated": totals.truncated,
            "errors": totals.errors,
        }

    async def _counts(self, user_id: str) -> dict[str, Any]:
        return {
            "sessions": await sessions.count(self.db, user_id),
            "turns": await turns.count(self.db, user_id),
            "chunks": await turns.count_chunks(self.db, user_id),
            "facts": await self.facts.count(user_id),
            "fact_versions": await self.facts.count(user_id, active_only=False),
            "pinned": await facts.count_pinned(self.db, user_id),
            "summaries": await summaries.count_current(self.db, user_id),
            "profile": await self.profiles.get(user_id) is not None,
            "consent": await self.profiles.consent(user_id),
        }

    async def _index(self, user_id: str) -> dict[str, Any]:
        vectors, total = await asyncio.gather(
            asyncio.to_thread(self.vectors.count, {"user_id": user_id}),
            asyncio.to_thread(self.vectors.count),
        )
        database = await self.db.size_bytes()
        vector_files = await asyncio.to_thread(_size, self.vectors_path)
        return {
            "vectors": vectors, "vectors_total": total,
            "database_bytes": database, "vectors_bytes": vector_files,
        }


def _rank(count: int, pct: int) -> int:
    """The index of the `pct` percentile among `count` sorted values (nearest rank)."""
    return min(count - 1, max(0, round(pct / 100 * count) - 1))


# `<created_at>:<id>` of the last row shown; every string of this shape is a valid cursor.
_CURSOR = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?(?:e[+-]?[0-9]{1,3})?):([0-9]{1,18})")


def _encode(created_at: float, row_id: int) -> str:
    return f"{created_at!r}:{row_id}"


def _decode(cursor: str) -> tuple[float, int]:
    match = _CURSOR.fullmatch(cursor)
    if match is None or not math.isfinite(float(match[1])):
        raise CursorError("invalid cursor")
    return float(match[1]), int(match[2])


def _size(folder: Path) -> int:
    """Bytes of the files under `folder`; a file removed while it is walked counts none."""
    total = 0
    for path in folder.rglob("*") if folder.is_dir() else ():
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size if path.is_file() else 0
    return total
