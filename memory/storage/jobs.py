"""Table `jobs`: the durable job queue (memory.jobs runs it).

    queued --claim--> running --complete--> done
                         |--retry_later--> queued (run_after in the future)
                         '--bury---------> dead (kept with its error)

A retry after an outage (memory.outages) does not count: it gives the job one more attempt
(`max_attempts + 1`), so its remaining attempts stay as they were while `attempts` still
only grows.

On SQLite one process owns the queue, and its next start requeues what a crash left running.
On PostgreSQL several replicas share it: a claim skips rows another replica is claiming
(FOR UPDATE SKIP LOCKED) and holds a lease (`lease_until`) that its worker renews while the
job runs; a running job whose lease ended belongs to a replica that died, and any replica
claims it again (or buries it when that was its last attempt, as a restart would).

Claims are fair between users: each job carries its `owner` (the user it works for; '' for
the system's own) and a `fair_at` time, its run_after or, when its owner already has jobs
waiting that are ready by then, FAIR_STEP seconds after the last of those. Claims go by fair_at, so a user who
queues 200 jobs at once has them spread 200 s into the future, and another user's job
queued a moment later goes ahead of all but the first (start-time fair queuing, with the
clock as virtual time); a job never waits behind more than one of each other owner's jobs
per FAIR_STEP. Both orders are index-backed (jobs_fair, jobs_by_owner).

A claim is named by the job's id and its attempt number (`attempts` only ever grows, and
every claim adds one): renewing and settling a job match both, so a worker that lost its
lease, and whose job another replica claimed since, can neither extend the new claim's lease
nor settle the job in its place (its complete() says False). The job may still have run twice
(a worker that outlives its lease cannot be stopped from outside): handlers stay idempotent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memory import tracing
from memory.storage.database import Connection, Transaction, first, marks, scalar

STATUSES = ("queued", "running", "done", "dead")
# How long a claim holds a job on PostgreSQL unless renewed (the default of the setting
# job_lease_seconds): a dead replica's job waits this long before another replica takes it
# over. Workers renew at a third of it.
LEASE_SECONDS = 60.0
# How far apart one owner's waiting jobs are placed in the fair order (seconds).
FAIR_STEP = 1.0
# The claim a renewal or settlement is for: still running, and not claimed again since.
_HELD = " AND status = 'running' AND attempts = ?"
_CRASHED = (
    "UPDATE jobs SET status = 'dead', updated_at = ?, last_error ="
    " 'the process stopped during its last attempt; last error: '"
    " || COALESCE(last_error, 'none')"
    " WHERE status = 'running' AND attempts >= max_attempts"
)


@dataclass(frozen=True, slots=True)
class Job:
    """A claimed job; `attempts` already counts the current one."""

    id: int
    kind: str
    payload: dict[str, Any]
    attempts: int
    max_attempts: int


@dataclass(frozen=True, slots=True)
class DeadJob:
    """A job that ran out of attempts, with the error that ended it."""

    id: int
    kind: str
    payload: dict[str, Any]
    attempts: int
    last_error: str | None
    updated_at: float


async def enqueue(
    tx: Transaction, kind: str, payload: Mapping[str, Any], *, max_attempts: int = 5,
    run_after: float | None = None, owner: str = "",
) -> int:
    """Queue a job for `owner` (a user id; '' for the system) that commits (or not) with
    `tx`; return its id."""
    now = time.time()
    ready = now if run_after is None else run_after
    if (queued_by := tracing.traceparent()) is not None:
        # The span that queued the job: the job's own span links back to it (memory/tracing.py).
        payload = {**payload, tracing.QUEUED_BY: queued_by}
    # Only the owner's jobs ready by then: a job delayed into the future (a retry's backoff)
    # must not push the owner's jobs that are ready now behind it.
    last = await first(
        tx, float, "SELECT MAX(fair_at) FROM jobs WHERE owner = ?"
        " AND status IN ('queued', 'running') AND run_after <= ?",
        (owner, ready),
    )
    fair_at = ready if last is None else max(ready, last + FAIR_STEP)
    return await scalar(
        tx, int, "INSERT INTO jobs (kind, payload, status, attempts, max_attempts, run_after,"
        " created_at, updated_at, owner, fair_at)"
        " VALUES (?, ?, 'queued', 0, ?, ?, ?, ?, ?, ?) RETURNING id",
        (kind, json.dumps(payload), max_attempts, ready, now, now, owner, fair_at),
    )  # fmt: skip


async def claim(
    tx: Transaction, kinds: Sequence[str] | None, limit: int, now: float, *,
    lease_seconds: float = LEASE_SECONDS,
) -> list[Job]:
    """Mark up to `limit` ready jobs running (attempts + 1) and return them, in fair order.

    On PostgreSQL the claim holds each job for `lease_seconds`, and jobs whose lease ended
    are ready again.
    """
    kind_filter = f" AND kind IN ({marks(len(kinds))})" if kinds is not None else ""
    if tx.dialect == "postgres":
        await tx.change(_CRASHED + " AND lease_until <= ?", (now, now))
        rows = await tx.fetch(
            "UPDATE jobs SET status = 'running', attempts = attempts + 1, updated_at = ?,"
            " lease_until = ? WHERE id IN (SELECT id FROM jobs WHERE"
            " ((status = 'queued' AND run_after <= ?) OR (status = 'running' AND lease_until <= ?))"
            f"{kind_filter} ORDER BY fair_at, id LIMIT ? FOR UPDATE SKIP LOCKED)"
            " RETURNING id, kind, payload, attempts, max_attempts, fair_at",
            [now, now + lease_seconds, now, now, *(kinds or ()), limit],
        )
    else:
        rows = await tx.fetch(
            "UPDATE jobs SET status = 'running', attempts = attempts + 1, updated_at = ?"
            " WHERE id IN (SELECT id FROM jobs WHERE status = 'queued' AND run_after <= ?"
            f"{kind_filter} ORDER BY fair_at, id LIMIT ?)"
            " RETURNING id, kind, payload, attempts, max_attempts, fair_at",
            [now, now, *(kinds or ()), limit],
        )
    rows.sort(key=lambda row: (row[5], row[0]))
    return [Job(row[0], row[1], json.loads(row[2]), row[3], row[4]) for row in rows]


async def renew(
    tx: Transaction, claims: Sequence[Job], now: float, *, lease_seconds: float = LEASE_SECONDS
) -> None:
    """Extend the leases of these claims that are still held (PostgreSQL; SQLite has no
    leases)."""
    if tx.dialect == "postgres" and claims:
        await tx.change(
            "UPDATE jobs SET lease_until = ? WHERE status = 'running'"
            " AND (id, attempts) IN (SELECT * FROM unnest(?::bigint[], ?::int[]))",
            (now + lease_seconds, [job.id for job in claims], [job.attempts for job in claims]),
        )


async def complete(tx: Transaction, job: Job) -> bool:
    """Mark a claimed job done; False when the claim was lost (the job is not changed)."""
    return await tx.change(
        "UPDATE jobs SET status = 'done', updated_at = ? WHERE id = ?" + _HELD,
        (time.time(), job.id, job.attempts),
    ) == 1


async def retry_later(
    tx: Transaction, job: Job, error: str, run_after: float, *, counted: bool = True
) -> None:
    """Put a claimed job back in the queue, not before `run_after`; `counted=False` (an
    outage) gives the attempt back."""
    # Only this claim: a late call must not revive a job already done, dead or claimed again.
    await tx.change(
        "UPDATE jobs SET status = 'queued', last_error = ?, run_after = ?, updated_at = ?,"
        " max_attempts = max_attempts + ? WHERE id = ?" + _HELD,
        (error, run_after, time.time(), 0 if counted else 1, job.id, job.attempts),
    )


async def bury(tx: Transaction, job: Job, error: str) -> None:
    """Move a claimed job to the dead letters, keeping its error."""
    await tx.change(
        "UPDATE jobs SET status = 'dead', last_error = ?, updated_at = ? WHERE id = ?" + _HELD,
        (error, time.time(), job.id, job.attempts),
    )


async def requeue_running(tx: Transaction) -> int:
    """Crash recovery: queue again the jobs left running (on PostgreSQL, only those whose
    lease ended: the others belong to live replicas); return how many."""
    now = time.time()
    expired, params = (" AND lease_until <= ?", (now,)) if tx.dialect == "postgres" else ("", ())
    # A job that was mid-attempt at every crash may be what crashes the process.
    await tx.change(_CRASHED + expired, (now, *params))
    return await tx.change(
        "UPDATE jobs SET status = 'queued', run_after = ?, updated_at = ? WHERE status = 'running'"
        + expired,
        (now, now, *params),
    )


async def expire_unleased(tx: Transaction) -> int:
    """End at once the lease of running jobs that have none (PostgreSQL): jobs a stopped
    embedded server left running, copied by `memproxy migrate`, are then taken over like a
    dead replica's; return how many."""
    return await tx.change(
        "UPDATE jobs SET lease_until = 0 WHERE status = 'running' AND lease_until IS NULL"
    )


async def next_due(conn: Connection) -> float | None:
    """When the earliest queued job becomes ready, or None when the queue is empty."""
    return await first(conn, float, "SELECT MIN(run_after) FROM jobs WHERE status = 'queued'")


async def pending(conn: Connection, due_before: float) -> int:
    """How many jobs are running or queued to become ready before `due_before`."""
    return await scalar(
        conn, int, "SELECT COUNT(*) FROM jobs WHERE status = 'running'"
        " OR (status = 'queued' AND run_after <= ?)",
        (due_before,),
    )


async def pending_between(conn: Connection, first: int, last: int) -> int:
    """How many jobs with ids from `first` to `last` are queued or running."""
    return await scalar(
        conn, int,
        "SELECT COUNT(*) FROM jobs WHERE id BETWEEN ? AND ? AND status IN ('queued', 'running')",
        (first, last),
    )


async def counts(conn: Connection) -> dict[str, int]:
    """Number of jobs in each status."""
    rows = await conn.fetch("SELECT status, COUNT(*) FROM jobs GROUP BY status")
    return dict.fromkeys(STATUSES, 0) | {str(row[0]): int(row[1]) for row in rows}


async def dead(conn: Connection, limit: int) -> list[DeadJob]:
    """The most recently buried jobs with their errors."""
    rows = await conn.fetch(
        "SELECT id, kind, payload, attempts, last_error, updated_at FROM jobs"
        " WHERE status = 'dead' ORDER BY updated_at DESC, id DESC LIMIT ?",
        (limit,),
    )
    return [DeadJob(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5]) for r in rows]


async def prune_done(tx: Transaction, older_than: float) -> int:
    """Delete finished jobs last updated before `older_than`; return how many."""
    return await tx.change(
        "DELETE FROM jobs WHERE status = 'done' AND updated_at < ?", (older_than,)
    )
