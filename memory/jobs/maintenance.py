"""Hourly upkeep: retention of metrics rows and finished jobs, fact expiry and eviction, and
the users' vector copies written to disk."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from config import Settings
from memory.index.vectors import VectorIndex
from memory.jobs.queue import JobQueue
from memory.learning.facts import FactStore
from memory.learning.lifecycle import prune_all, purge_expired
from memory.storage import metrics
from memory.storage.database import Database

INTERVAL = 3600.0
DONE_JOB_RETENTION = 7 * 86400.0
log = logging.getLogger("memproxy.memory")


@dataclass(eq=False)
class Maintenance:
    """Pruning and the copies' saving, run now (`prune`) or every hour (`run`)."""

    settings: Settings
    db: Database
    queue: JobQueue
    facts: FactStore
    vectors: VectorIndex

    async def prune(self, now: float | None = None) -> dict[str, int]:
        """Drop metrics rows past retention, finished jobs older than a week, long-expired
        facts, and evict facts of users above `fact_prune_at`."""
        now = time.time() if now is None else now
        retention = self.settings.metrics_retention_days * 86400.0
        expired_cutoff = now - self.settings.fact_expired_retention_days * 86400.0
        keep = min(self.settings.fact_prune_at, self.settings.fact_cap)
        async with self.db.autocommit() as tx:
            pruned_metrics = await metrics.prune(tx, now - retention)
        return {
            "request_metrics": pruned_metrics,
            "done_jobs": await self.queue.prune_done_jobs(now - DONE_JOB_RETENTION),
            "expired_facts": await purge_expired(self.facts, expired_cutoff),
            "evicted_facts": await prune_all(self.facts, keep, now),
        }

    async def run(self) -> None:
        """Every INTERVAL until cancelled; a failed round is logged and retried next time."""
        while True:
            try:
                await self.prune()
                # After a crash, only users changed within the last interval load from Chroma.
                await asyncio.to_thread(self.vectors.save_copies)
            except Exception:  # retried next round; never kills the engine
                log.warning("pruning failed", exc_info=True)
            await asyncio.sleep(INTERVAL)
