"""Runs the durable job queue (`JobQueue`): claim ready jobs, run their handlers
concurrently, retry failures with exponential backoff and bury the ones that keep failing.

A job is never lost: it is claimed and settled through the database, a job interrupted by
`stop()` goes back to the queue, and one left running by a crash is queued again by the next
`start()` (on PostgreSQL: claimed by any replica once its lease ends; `_renew_leases` keeps the
leases of running jobs). Delivery is therefore at-least-once, so handlers must be idempotent.

A kind with a batch handler is claimed in groups: the ready jobs of that kind (up to
`batch_size`) run in one call, in one slot, so work that arrived together (one index job per
chat request) is done together (one embedding batch). When the call fails, each job of the
group is retried alone (after its backoff; at once if that was its last attempt), so a bad job
fails by itself and an outage costs no more calls than without batches.

An outage is waited out, not counted (memory.outages): an attempt that failed because
PostgreSQL, Chroma or the upstream did not answer goes back to the queue without spending an
attempt, after a backoff capped at `outage_backoff_max` seconds, however long the outage
lasts; only errors of the job itself lead to the dead letters. Settling a job (done, retry,
dead) waits for the database the same way instead of giving up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeVar

from memory import tracing
from memory.jobs.queue import JobQueue
from memory.outages import is_outage
from memory.storage.jobs import Job

Handler = Callable[[dict[str, Any]], Awaitable[None]]
BatchHandler = Callable[[list[dict[str, Any]]], Awaitable[None]]


class JobFailed(Exception):
    """A failure no retry can fix (e.g. unusable model output): the job is buried at once,
    with the whole message (up to 32k characters) kept as its error."""


log = logging.getLogger(f"memproxy.{__name__}")  # under memproxy: configure_logging formats it

_MAX_ERROR_CHARS = 4000
_MAX_FAILED_CHARS = 32000
_IDLE_CHECK_INTERVAL = 0.01
_MIN_OUTAGE_WAIT = 0.1
_T = TypeVar("_T")


@dataclass(eq=False)
class JobWorker:
    """Claims jobs from a JobQueue and runs the handler registered for each kind."""

    store: JobQueue
    handlers: Mapping[str, Handler]
    _: KW_ONLY
    batch_handlers: Mapping[str, BatchHandler] = field(default_factory=dict)
    batch_size: int = 1
    concurrency: int = 2
    poll_interval: float = 1.0
    backoff_base: float = 1.0
    backoff_max: float = 300.0
    outage_backoff_max: float = 15.0
    clock: Callable[[], float] = time.time
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _loop_task: asyncio.Task[None] | None = field(default=None, init=False)
    _running: dict[asyncio.Task[None], list[Job]] = field(default_factory=dict, init=False)
    _stopping: bool = field(default=False, init=False)
    _stopped: asyncio.Task[None] | None = field(default=None, init=False)
    _renewed: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.batch_size = max(1, self.batch_size)
        self.handlers, self.batch_handlers = dict(self.handlers), dict(self.batch_handlers)

    async def start(self) -> None:
        """Requeue jobs a crash left running, then start claiming."""
        if self._loop_task is not None:
            raise RuntimeError("the job worker is already started")
        requeued = await self.store.requeue_running()
        if requeued:
            log.info("requeued %d job(s) left running by a previous process", requeued)
        self._loop_task = asyncio.create_task(self._loop(), name="job-worker")

    def notify(self) -> None:
        """Look for ready jobs now instead of at the next poll."""
        self._wake.set()

    async def stop(self, timeout: float) -> None:
        """Stop claiming, give running handlers `timeout` seconds, then cancel and requeue them.

        A second call waits for the first stop to finish (its timeout counts).
        """
        if self._stopped is None:
            self._stopped = asyncio.get_running_loop().create_task(self._stop(timeout))
        await asyncio.shield(self._stopped)

    async def _stop(self, timeout: float) -> None:
        self._stopping = True
        self._wake.set()
        if self._loop_task is not None:
            await self._loop_task
        in_flight = dict(self._running)
        if not in_flight:
            return
        _, unfinished = await asyncio.wait(in_flight, timeout=timeout)
        for task in unfinished:
            task.cancel()
        if unfinished:
            await asyncio.wait(unfinished, timeout=timeout)
        for task in unfinished:
            for job in in_flight[task]:
                # Guarded in the store: a job the handler settled anyway stays settled.
                try:
                    await self.store.retry_later(
                        job, "interrupted: the worker stopped during this attempt",
                        run_after=self.clock(),
                    )
                except Exception as exc:
                    if not is_outage(exc):
                        raise
                    # Still running in the database: the next start (SQLite) or the end of
                    # its lease (PostgreSQL) queues it again.
                    log.warning("job %d could not be requeued at stop: %s", job.id, exc)
        log.info("job worker stopped; %d unfinished job(s) requeued", len(unfinished))

    async def run_until_idle(self, timeout: float) -> None:
        """Return once no job runs and none is due within `timeout`; else raise TimeoutError."""
        if self._loop_task is None:
            raise RuntimeError("start() the job worker first")
        deadline = self.clock() + timeout
        async with asyncio.timeout(timeout):
            # Ask the database, not self._running: a job's status changes atomically, while
            # a just-claimed job is briefly in neither the queue nor self._running.
            while await self.store.pending_jobs(due_before=deadline):
                self.notify()
                await asyncio.sleep(_IDLE_CHECK_INTERVAL)

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after failed attempt number `attempts`: doubling, jittered, capped."""
        # Jitter spreads retries of jobs that failed together (e.g. an upstream outage).
        delay = self.backoff_base * 2.0 ** min(attempts - 1, 60) * random.uniform(1.0, 1.1)
        return min(self.backoff_max, delay)

    def outage_backoff(self, attempts: int) -> float:
        """Seconds to wait after failure number `attempts` on an outage: the backoff, capped
        at `outage_backoff_max`, and never below a tenth of a second (no busy loop)."""
        return max(_MIN_OUTAGE_WAIT, min(self.backoff(attempts), self.outage_backoff_max))

    async def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                await self._renew_leases()
                delay = await self._claim_ready()
            except Exception as exc:  # the worker must outlive a transient database error
                if is_outage(exc):
                    log.warning("job worker: the database is unreachable; claiming again after"
                                " a poll interval: %s", exc)
                else:
                    log.exception("job worker: claiming jobs failed; retrying after a poll interval")
                delay = self.poll_interval
            if delay > 0:
                await self._sleep(delay)

    async def _claim_ready(self) -> float:
        """Start ready jobs in the free slots; return how long to sleep before looking again."""
        free = self.concurrency - len(self._running)
        if free <= 0:
            return self.poll_interval  # a finishing job wakes the loop
        jobs = await self.store.claim(None, free, self.clock())
        for group in await self._grouped(jobs):
            first = group[0]
            run = self._run(first) if len(group) == 1 else self._run_batch(group)
            task = asyncio.create_task(run, name=f"job-{first.id}-{first.kind}")
            self._running[task] = group
            task.add_done_callback(self._finished)
        if len(jobs) == free:
            return 0.0  # there may be more ready jobs than there were slots
        due = await self.store.next_job_due()
        if due is None:
            return self.poll_interval
        return min(self.poll_interval, max(0.0, due - self.clock()))

    async def _renew_leases(self) -> None:
        """Keep the leases of the running jobs, so no other replica takes them over."""
        now = self.clock()
        # Every third of a lease: a lease survives two failed renewals.
        if self._running and now - self._renewed >= self.store.lease_seconds / 3:
            await self.store.renew([job for group in self._running.values() for job in group], now)
            self._renewed = now

    async def _grouped(self, jobs: list[Job]) -> list[list[Job]]:
        """One group per claimed job, except that first attempts of a batchable kind form
        groups of up to `batch_size`, topped up with more ready jobs of that kind."""
        groups: list[list[Job]] = []
        batches: dict[str, list[Job]] = {}

        def place(job: Job) -> None:
            # A retried job runs alone: it (or one batched with it) failed before.
            if job.kind not in self.batch_handlers or job.attempts > 1:
                groups.append([job])
                return
            batch = batches.get(job.kind)
            if batch is None or len(batch) >= self.batch_size:
                batch = batches[job.kind] = []
                groups.append(batch)
            batch.append(job)

        for job in jobs:
            place(job)
        for kind, batch in list(batches.items()):
            if len(batch) < self.batch_size:
                room = self.batch_size - len(batch)
                for job in await self.store.claim([kind], room, self.clock()):
                    place(job)
        return groups

    async def _run_batch(self, jobs: list[Job]) -> None:
        try:
            with _span(jobs):
                await self.batch_handlers[jobs[0].kind]([_payload(job) for job in jobs])
        except Exception as exc:  # which job caused it is unknown: each is retried alone
            outage = is_outage(exc)  # none of them did: the batch is retried as it was
            if not outage:
                log.warning("a batch of %d %s jobs failed (%s: %s); each will run alone",
                            len(jobs), jobs[0].kind, type(exc).__name__, str(exc)[:200])
            for job in jobs:
                if job.attempts >= job.max_attempts and not outage:
                    await self._run(job)  # its last attempt: it gets one of its own
                else:
                    await self._failed(job, exc)
            return
        for job in jobs:
            await self._complete(job)

    async def _sleep(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._wake.wait()

    async def _run(self, job: Job) -> None:
        handler = self.handlers.get(job.kind)
        if handler is None:
            log.error("job %d has kind %r, which has no handler; burying it", job.id, job.kind)
            error = f"no handler is registered for job kind {job.kind!r}"
            await self._settle(job, lambda: self.store.bury(job, error))
            return
        try:
            with _span([job]):
                await handler(_payload(job))
        except JobFailed as exc:
            log.error("job %d (%s) failed for good: %s", job.id, job.kind, str(exc)[:200])
            error = str(exc)[:_MAX_FAILED_CHARS]
            await self._settle(job, lambda: self.store.bury(job, error))
        except Exception as exc:  # a handler's failure belongs to its job: retry or bury
            await self._failed(job, exc)
        except asyncio.CancelledError as exc:
            if (task := asyncio.current_task()) is not None and task.cancelling() > 0:
                raise  # stop() is cancelling us and will requeue the job
            # Nobody cancelled this task: a cancelled future inside the handler leaked out.
            await self._failed(job, exc)
        else:
            await self._complete(job)

    async def _complete(self, job: Job) -> None:
        if not await self._settle(job, lambda: self.store.complete(job)):
            log.warning("job %d (%s) finished after losing its lease: its new claim settles it",
                        job.id, job.kind)

    async def _failed(self, job: Job, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
        if is_outage(exc):
            delay = self.outage_backoff(job.attempts)
            log.warning("job %d (%s) met an outage, retrying in %.1fs (attempt not counted): %s",
                        job.id, job.kind, delay, error)
            await self._settle(job, lambda: self.store.retry_later(
                job, error, run_after=self.clock() + delay, counted=False))
            return
        what = f"job {job.id} ({job.kind}) failed attempt {job.attempts} of {job.max_attempts}"
        if job.attempts >= job.max_attempts:
            log.error("%s and is dead: %s", what, error, exc_info=exc)
            await self._settle(job, lambda: self.store.bury(job, error))
            return
        delay = self.backoff(job.attempts)
        log.warning("%s, retrying in %.1fs: %s", what, delay, error)
        await self._settle(job, lambda: self.store.retry_later(
            job, error, run_after=self.clock() + delay))

    async def _settle(self, job: Job, settle: Callable[[], Awaitable[_T]]) -> _T:
        """Record a job's outcome; while the database is unreachable, wait for it (capped
        backoff) rather than leave the job running until a restart or its lease's end."""
        waits = 0
        while True:
            try:
                return await settle()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                waits += 1
                delay = self.outage_backoff(waits)
                if waits == 1:
                    log.warning("job %d (%s) waits for the database to settle: %s",
                                job.id, job.kind, exc)
                await asyncio.sleep(delay)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        self._wake.set()
        if not task.cancelled() and (exc := task.exception()) is not None:
            # Only settling failed (e.g. the database went away); start() will requeue it.
            log.error("%s could not be settled", task.get_name(), exc_info=exc)


def _span(jobs: list[Job]) -> AbstractContextManager[tracing.Span]:
    """The span of one run of `jobs` (one, or a batch of one kind): a trace of its own,
    linked to the spans that queued each job (docs/tracing.md)."""
    links = [queued for job in jobs if isinstance(queued := job.payload.get(tracing.QUEUED_BY), str)]
    return tracing.linked(f"memproxy.job {jobs[0].kind}", links, {
        "memproxy.job.kind": jobs[0].kind, "memproxy.job.count": len(jobs),
        "memproxy.job.ids": [job.id for job in jobs],
        "memproxy.job.attempt": max(job.attempts for job in jobs),
    })


def _payload(job: Job) -> dict[str, Any]:
    """What the handler gets: the payload without the tracing's link."""
    if tracing.QUEUED_BY not in job.payload:
        return job.payload
    return {key: value for key, value in job.payload.items() if key != tracing.QUEUED_BY}
