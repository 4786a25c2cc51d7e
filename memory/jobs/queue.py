"""The job queue as the worker and the stats see it: each call is one write (or read) of
the `jobs` table (memory.storage.jobs). Jobs that must commit with other rows are queued
with `memory.storage.jobs.enqueue` inside that write's transaction instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memory.storage import jobs
from memory.storage.database import Database
from memory.storage.jobs import DeadJob, Job


class JobQueue:
    """The durable queue in one database. On PostgreSQL a claim holds a job for
    `lease_seconds` unless renewed (the worker renews at a third of it)."""

    def __init__(self, db: Database, *, lease_seconds: float = jobs.LEASE_SECONDS) -> None:
        self.db = db
        self.lease_seconds = lease_seconds

    async def enqueue(
        self, kind: str, payload: Mapping[str, Any], *, max_attempts: int = 5,
        run_after: float | None = None, owner: str = "",
    ) -> int:
        """Queue a job for `owner` (a user id; '' for the system) and return its id."""
        async with self.db.autocommit() as tx:
            return await jobs.enqueue(
                tx, kind, payload, max_attempts=max_attempts, run_after=run_after, owner=owner
            )

    async def claim(self, kinds: Sequence[str] | None, limit: int, now: float) -> list[Job]:
        """Mark up to `limit` ready jobs running (attempts + 1) and return them, in the fair
        order between users (memory/storage/jobs.py)."""
        if limit <= 0 or (kinds is not None and not kinds):
            return []
        async with self.db.autocommit() as tx:
            return await jobs.claim(tx, kinds, limit, now, lease_seconds=self.lease_seconds)

    async def renew(self, claims: Sequence[Job], now: float) -> None:
        """Extend the leases of these claims that are still held (PostgreSQL)."""
        async with self.db.autocommit() as tx:
            await jobs.renew(tx, claims, now, lease_seconds=self.lease_seconds)

    async def complete(self, job: Job) -> bool:
        """Mark a claimed job done; False when the claim was lost meanwhile."""
        async with self.db.autocommit() as tx:
            return await jobs.complete(tx, job)

    async def retry_later(
        self, job: Job, error: str, run_after: float, *, counted: bool = True
    ) -> None:
        """Put a claimed job back in the queue, not before `run_after` (`counted=False`: the
        attempt failed on an outage and is given back)."""
        async with self.db.autocommit() as tx:
            await jobs.retry_later(tx, job, error, run_after, counted=counted)

    async def bury(self, job: Job, error: str) -> None:
        """Move a claimed job to the dead letters, keeping its error."""
        async with self.db.autocommit() as tx:
            await jobs.bury(tx, job, error)

    async def requeue_running(self) -> int:
        """Crash recovery: queue again the jobs left running; return how many."""
        async with self.db.write() as tx:
            return await jobs.requeue_running(tx)

    async def next_job_due(self) -> float | None:
        """When the earliest queued job becomes ready, or None when the queue is empty."""
        return await jobs.next_due(self.db)

    async def pending_jobs(self, due_before: float) -> int:
        """How many jobs are running or queued to become ready before `due_before`."""
        return await jobs.pending(self.db, due_before)

    async def job_counts(self) -> dict[str, int]:
        """Number of jobs in each status."""
        return await jobs.counts(self.db)

    async def dead_jobs(self, limit: int = 100) -> list[DeadJob]:
        """The most recently buried jobs with their errors."""
        return await jobs.dead(self.db, limit)

    async def prune_done_jobs(self, older_than: float) -> int:
        """Delete finished jobs last updated before `older_than`; return how many."""
        async with self.db.autocommit() as tx:
            return await jobs.prune_done(tx, older_than)
