"""JobWorker over a real Store: completion, retries with backoff, dead letters, crash
recovery, graceful stop and concurrency, on SQLite and on PostgreSQL; and replicas sharing
one PostgreSQL queue: claims that never collide, leases taken over when a replica dies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from memory.jobs.queue import JobQueue
from memory.jobs.worker import Handler, JobWorker
from memory.storage.jobs import LEASE_SECONDS
from tests.support.servers import PostgresServer
from tests.support.storage import Storage

pytestmark = pytest.mark.both_backends


@pytest.fixture
async def store(tmp_path: Path, database_url: str | None) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "memory.db", url=database_url)
    yield store
    await store.close()


@pytest.fixture
async def make_worker(store: Storage) -> AsyncIterator[Callable[..., JobWorker]]:
    """Build started-later workers with fast timings; every one is stopped at teardown."""
    workers: list[JobWorker] = []

    def make(handlers: Mapping[str, Handler], **options: Any) -> JobWorker:
        options = {"poll_interval": 0.05, "backoff_base": 0.02, **options}
        worker = JobWorker(options.pop("store", store).queue, handlers, **options)
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        await worker.stop(timeout=1)


class Recorder:
    """A handler that records its calls and fails the first `failures` of them."""

    def __init__(self, failures: int = 0, error: Exception | None = None) -> None:
        self.calls: list[tuple[float, dict[str, Any]]] = []
        self.failures = failures
        self.error = error or ValueError("boom")

    async def __call__(self, payload: dict[str, Any]) -> None:
        self.calls.append((time.time(), payload))
        if len(self.calls) <= self.failures:
            raise self.error


async def test_a_job_runs_once_and_is_done(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    handler = Recorder()
    worker = make_worker({"index": handler})
    await worker.start()

    await store.queue.enqueue("index", {"turn_ids": [1, 2]})
    worker.notify()
    await worker.run_until_idle(timeout=5)

    assert [payload for _, payload in handler.calls] == [{"turn_ids": [1, 2]}]
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 1, "dead": 0}


async def test_a_failing_job_backs_off_then_is_buried_with_its_error(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    # A job error: an outage (a refused connection) would not count (tests/test_outages.py).
    handler = Recorder(failures=99, error=ValueError("unusable model reply"))
    worker = make_worker({"extract": handler}, backoff_base=0.05)
    await worker.start()

    job_id = await store.queue.enqueue("extract", {"n": 1}, max_attempts=3)
    await worker.run_until_idle(timeout=5)

    assert len(handler.calls) == 3
    first_gap = handler.calls[1][0] - handler.calls[0][0]
    second_gap = handler.calls[2][0] - handler.calls[1][0]
    assert first_gap >= 0.05 and second_gap >= 0.1  # base * 2 ** (attempt - 1)
    (dead,) = await store.queue.dead_jobs(10)
    assert (dead.id, dead.kind, dead.attempts) == (job_id, "extract", 3)
    assert dead.last_error == "ValueError: unusable model reply"
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 0, "dead": 1}


async def test_a_job_that_fails_once_succeeds_on_retry(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    handler = Recorder(failures=1)
    worker = make_worker({"index": handler})
    await worker.start()

    await store.queue.enqueue("index", {})
    await worker.run_until_idle(timeout=5)

    assert len(handler.calls) == 2
    assert (await store.queue.job_counts())["done"] == 1


async def test_an_unknown_kind_is_buried_at_once(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    worker = make_worker({"index": Recorder()})
    await worker.start()

    await store.queue.enqueue("summarise", {}, max_attempts=5)
    await worker.run_until_idle(timeout=5)

    (dead,) = await store.queue.dead_jobs(10)
    assert dead.attempts == 1
    assert dead.last_error == "no handler is registered for job kind 'summarise'"


async def test_a_job_running_at_a_crash_is_retried_after_restart(
    tmp_path: Path, database_url: str | None, make_worker: Callable[..., JobWorker]
) -> None:
    path = tmp_path / "crash.db"
    crashed = await Storage.open(path, url=database_url)
    job_id = await crashed.queue.enqueue("index", {"turn_ids": [7]}, run_after=0)
    # Claimed longer ago than a lease (PostgreSQL) lasts: its process is gone for good.
    claimed = await crashed.queue.claim(None, 1, now=time.time() - LEASE_SECONDS - 1)
    assert [job.id for job in claimed] == [job_id]
    await crashed.close()  # the process dies mid-job: nothing settles it

    restarted = await Storage.open(path, url=database_url)
    try:
        handler = Recorder()
        worker = make_worker({"index": handler}, store=restarted)
        await worker.start()
        await worker.run_until_idle(timeout=5)

        assert [payload for _, payload in handler.calls] == [{"turn_ids": [7]}]
        assert (await restarted.queue.job_counts())["done"] == 1
        await worker.stop(timeout=1)
    finally:
        await restarted.close()


async def test_stop_requeues_a_job_whose_handler_is_too_slow(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(payload: dict[str, Any]) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    worker = make_worker({"index": slow})
    await worker.start()
    await store.queue.enqueue("index", {"n": 1})
    await asyncio.wait_for(started.wait(), timeout=5)

    await worker.stop(timeout=0.05)

    assert cancelled.is_set()
    assert await store.queue.job_counts() == {"queued": 1, "running": 0, "done": 0, "dead": 0}
    handler = Recorder()
    successor = make_worker({"index": handler})
    await successor.start()
    await successor.run_until_idle(timeout=5)
    assert [payload for _, payload in handler.calls] == [{"n": 1}]


async def test_a_cancelled_error_from_inside_a_handler_is_a_failure(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    async def leaks_cancellation(payload: dict[str, Any]) -> None:
        inner = asyncio.get_running_loop().create_future()
        inner.cancel()
        await inner

    worker = make_worker({"index": leaks_cancellation})
    await worker.start()
    await store.queue.enqueue("index", {}, max_attempts=1)
    await worker.run_until_idle(timeout=5)

    (dead,) = await store.queue.dead_jobs(5)
    assert dead.last_error is not None and dead.last_error.startswith("CancelledError")


async def test_stop_lets_a_handler_that_finishes_in_time_complete(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    started = asyncio.Event()

    async def brief(payload: dict[str, Any]) -> None:
        started.set()
        await asyncio.sleep(0.05)

    worker = make_worker({"index": brief})
    await worker.start()
    await store.queue.enqueue("index", {})
    await asyncio.wait_for(started.wait(), timeout=5)

    await worker.stop(timeout=5)

    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 1, "dead": 0}


async def test_a_second_stop_waits_for_the_first_and_keeps_its_timeout(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    started = asyncio.Event()

    async def endless(payload: dict[str, Any]) -> None:
        started.set()
        await asyncio.sleep(60)

    worker = make_worker({"index": endless})
    await worker.start()
    await store.queue.enqueue("index", {})
    await asyncio.wait_for(started.wait(), timeout=5)

    began = time.monotonic()
    first = asyncio.create_task(worker.stop(timeout=0.3))  # begun at the signal
    await asyncio.sleep(0.05)
    await worker.stop(timeout=30)  # the close after it: waits, does not start again
    assert first.done() and time.monotonic() - began < 2
    counts = await store.queue.job_counts()
    assert counts == {"queued": 1, "running": 0, "done": 0, "dead": 0}  # requeued once


async def test_handlers_run_concurrently_up_to_the_limit(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    active, peak = 0, 0

    async def handler(payload: dict[str, Any]) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.05)
        active -= 1

    worker = make_worker({"index": handler}, concurrency=3)
    for n in range(9):
        await store.queue.enqueue("index", {"n": n})
    await worker.start()
    await worker.run_until_idle(timeout=5)

    assert peak == 3  # never more than the limit, and the limit was reached
    assert (await store.queue.job_counts())["done"] == 9


async def test_notify_wakes_the_worker_without_waiting_for_the_poll(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    ran = asyncio.Event()

    async def handler(payload: dict[str, Any]) -> None:
        ran.set()

    worker = make_worker({"index": handler}, poll_interval=60)
    await worker.start()
    await asyncio.sleep(0.01)  # let the loop go to sleep on an empty queue

    await store.queue.enqueue("index", {})
    worker.notify()

    await asyncio.wait_for(ran.wait(), timeout=2)


async def test_run_until_idle_times_out_while_a_job_is_still_running(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    async def stuck(payload: dict[str, Any]) -> None:
        await asyncio.sleep(60)

    worker = make_worker({"index": stuck})
    await worker.start()
    await store.queue.enqueue("index", {})

    with pytest.raises(TimeoutError):
        await worker.run_until_idle(timeout=0.2)


async def test_run_until_idle_ignores_jobs_due_after_the_timeout(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    handler = Recorder()
    worker = make_worker({"index": handler})
    await worker.start()
    await store.queue.enqueue("index", {}, run_after=time.time() + 3600)

    await worker.run_until_idle(timeout=1)

    assert handler.calls == []
    assert (await store.queue.job_counts())["queued"] == 1


async def test_backoff_doubles_and_is_capped(store: Storage) -> None:
    worker = JobWorker(store.queue, {}, backoff_base=1.0, backoff_max=10.0)

    assert 1.0 <= worker.backoff(1) <= 1.1
    assert 2.0 <= worker.backoff(2) <= 2.2
    assert 4.0 <= worker.backoff(3) <= 4.4
    assert worker.backoff(4) == pytest.approx(8.0, rel=0.1)
    assert worker.backoff(5) == 10.0
    assert worker.backoff(500) == 10.0


async def test_jobs_of_a_batch_kind_ready_together_run_in_one_call(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    batches: list[list[int]] = []
    single = Recorder()

    async def batch(payloads: list[dict[str, Any]]) -> None:
        batches.append([payload["n"] for payload in payloads])

    for n in range(7):
        await store.queue.enqueue("index", {"n": n})
    await store.queue.enqueue("summary", {"n": 99})
    worker = make_worker(
        {"index": single, "summary": single}, batch_handlers={"index": batch}, batch_size=5,
        concurrency=2,
    )
    await worker.start()
    await worker.run_until_idle(timeout=5)

    assert batches == [[0, 1, 2, 3, 4], [5, 6]]  # oldest first, at most batch_size a call
    assert [payload for _, payload in single.calls] == [{"n": 99}]
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 8, "dead": 0}


async def test_a_failed_batch_runs_each_job_alone_so_only_the_bad_one_fails(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    alone: list[int] = []

    async def batch(payloads: list[dict[str, Any]]) -> None:
        if any(payload["n"] == 2 for payload in payloads):
            raise ValueError("bad turn")

    async def single(payload: dict[str, Any]) -> None:
        alone.append(payload["n"])
        await batch([payload])

    for n in range(4):
        await store.queue.enqueue("index", {"n": n}, max_attempts=1)
    worker = make_worker({"index": single}, batch_handlers={"index": batch}, batch_size=8)
    await worker.start()
    await worker.run_until_idle(timeout=5)

    assert alone == [0, 1, 2, 3]
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 3, "dead": 1}
    assert [dead.payload["n"] for dead in await store.queue.dead_jobs()] == [2]


async def test_after_a_failed_batch_each_job_is_retried_alone(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    batches: list[list[int]] = []
    single = Recorder()

    async def batch(payloads: list[dict[str, Any]]) -> None:
        batches.append([payload["n"] for payload in payloads])
        raise ValueError("embedding service overloaded")

    for n in range(3):
        await store.queue.enqueue("index", {"n": n}, max_attempts=3)
    worker = make_worker({"index": single}, batch_handlers={"index": batch}, batch_size=8)
    await worker.start()
    await worker.run_until_idle(timeout=5)

    assert batches == [[0, 1, 2]]  # one call for the first attempt of all three
    assert sorted(payload["n"] for _, payload in single.calls) == [0, 1, 2]  # then one each
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 3, "dead": 0}


async def test_stop_requeues_every_job_of_an_unfinished_batch(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    started = asyncio.Event()

    async def slow(payloads: list[dict[str, Any]]) -> None:
        started.set()
        await asyncio.sleep(60)

    for n in range(3):
        await store.queue.enqueue("index", {"n": n})
    worker = make_worker({"index": Recorder()}, batch_handlers={"index": slow}, batch_size=8)
    await worker.start()
    await asyncio.wait_for(started.wait(), timeout=5)

    await worker.stop(timeout=0.05)

    assert await store.queue.job_counts() == {"queued": 3, "running": 0, "done": 0, "dead": 0}


async def test_a_batch_size_of_one_runs_each_job_alone(
    store: Storage, make_worker: Callable[..., JobWorker]
) -> None:
    batches: list[list[int]] = []

    async def batch(payloads: list[dict[str, Any]]) -> None:
        batches.append([payload["n"] for payload in payloads])

    for n in range(3):
        await store.queue.enqueue("index", {"n": n})
    handler = Recorder()
    worker = make_worker({"index": handler}, batch_handlers={"index": batch}, batch_size=1,
                         concurrency=3)
    await worker.start()
    await worker.run_until_idle(timeout=5)

    assert batches == []
    assert sorted(payload["n"] for _, payload in handler.calls) == [0, 1, 2]


# -- replicas sharing one queue ----------------------------------------------------------------


async def test_two_replicas_claiming_at_once_never_take_the_same_job(
    tmp_path: Path, database_url: str | None
) -> None:
    replicas = [await Storage.open(tmp_path / "memory.db", url=database_url) for _ in range(2)]
    try:
        for n in range(40):
            await replicas[0].queue.enqueue("index", {"n": n})
        claims = [replicas[i % 2].queue.claim(None, 3, now=time.time()) for i in range(20)]
        ids = [job.id for batch in await asyncio.gather(*claims) for job in batch]
        assert len(ids) == len(set(ids)) == 40
        assert (await replicas[1].queue.job_counts())["running"] == 40
    finally:
        for replica in replicas:
            await replica.close()


@pytest.fixture
async def replicas(
    tmp_path: Path, postgres_server: PostgresServer
) -> AsyncIterator[tuple[Storage, Storage]]:
    """Two replicas' databases on one PostgreSQL (leases exist only there)."""
    url = postgres_server.create_database()
    first = await Storage.open(tmp_path / "unused", url=url)
    second = await Storage.open(tmp_path / "unused", url=url)
    yield first, second
    await first.close()
    await second.close()


async def test_a_job_whose_lease_ended_is_taken_over_by_another_replica(
    replicas: tuple[Storage, Storage],
) -> None:
    dying, survivor = replicas
    job_id = await dying.queue.enqueue("index", {"turn_ids": [7]}, run_after=0)
    # The dying replica's lease ends half a second from now, and nobody renews it.
    (claimed,) = await dying.queue.claim(None, 1, now=time.time() - LEASE_SECONDS + 0.5)
    assert claimed.id == job_id
    assert await survivor.queue.claim(None, 1, now=time.time()) == []  # the lease still holds

    handler = Recorder()
    worker = JobWorker(survivor.queue, {"index": handler}, poll_interval=0.05)
    await worker.start()
    try:
        await asyncio.sleep(0.6)
        await worker.run_until_idle(timeout=5)
    finally:
        await worker.stop(timeout=1)

    assert [payload for _, payload in handler.calls] == [{"turn_ids": [7]}]
    assert await survivor.queue.job_counts() == {"queued": 0, "running": 0, "done": 1, "dead": 0}


async def test_a_renewed_lease_keeps_the_job_and_a_last_attempt_is_buried_when_it_ends(
    replicas: tuple[Storage, Storage],
) -> None:
    owner, other = replicas
    kept = await owner.queue.enqueue("index", {}, run_after=0)
    crasher = await owner.queue.enqueue("index", {}, max_attempts=1, run_after=0)
    claimed = await owner.queue.claim(None, 2, now=time.time() - LEASE_SECONDS + 0.3)
    assert [job.id for job in claimed] == [kept, crasher]

    await owner.queue.renew([claimed[0]], time.time())
    await asyncio.sleep(0.4)

    assert await other.queue.claim(None, 5, now=time.time()) == []
    assert await other.queue.job_counts() == {"queued": 0, "running": 1, "done": 0, "dead": 1}
    (dead,) = await other.queue.dead_jobs(5)
    assert dead.id == crasher and "stopped during its last attempt" in (dead.last_error or "")


async def test_a_worker_that_lost_its_lease_cannot_settle_the_job_its_new_claim_owns(
    replicas: tuple[Storage, Storage],
) -> None:
    slow, survivor = replicas
    job_id = await slow.queue.enqueue("index", {}, run_after=0)
    started, release = asyncio.Event(), asyncio.Event()

    async def stuck(payload: dict[str, Any]) -> None:
        started.set()
        await release.wait()

    worker = JobWorker(slow.queue, {"index": stuck}, poll_interval=0.05)
    await worker.start()
    try:
        await asyncio.wait_for(started.wait(), 5)
        # Seen from a lease later: the slow replica's claim has ended, the survivor's begins.
        (taken,) = await survivor.queue.claim(None, 1, now=time.time() + LEASE_SECONDS + 1)
        assert (taken.id, taken.attempts) == (job_id, 2)
        release.set()
        await asyncio.sleep(0.3)
        # The slow replica finished, but its claim was no longer the job's: nothing settled.
        assert await slow.queue.job_counts() == {"queued": 0, "running": 1, "done": 0, "dead": 0}
        # Nor can it renew the new claim's lease (the survivor's claim runs a lease from now).
        await slow.queue.renew([replace(taken, attempts=1)], time.time() + 10 * LEASE_SECONDS)
        ((lease_until,),) = await slow.db.fetch("SELECT lease_until FROM jobs")
        assert lease_until < time.time() + 3 * LEASE_SECONDS
    finally:
        await worker.stop(timeout=1)
    assert await survivor.queue.complete(taken)
    assert not await slow.queue.complete(replace(taken, attempts=1))
    assert await survivor.queue.job_counts() == {"queued": 0, "running": 0, "done": 1, "dead": 0}


async def test_a_short_lease_is_renewed_while_its_job_runs(
    replicas: tuple[Storage, Storage],
) -> None:
    owner, other = replicas
    leased = JobQueue(owner.db, lease_seconds=0.6)  # as MEMPROXY_JOB_LEASE_SECONDS=0.6 would
    await leased.enqueue("index", {}, run_after=0)
    handler = Recorder()

    async def slow(payload: dict[str, Any]) -> None:
        await handler(payload)
        await asyncio.sleep(1.5)

    worker = JobWorker(leased, {"index": slow}, poll_interval=0.05)
    await worker.start()
    try:
        for _ in range(12):  # 1.2 s: twice the lease, which renewals keep
            await asyncio.sleep(0.1)
            assert await other.queue.claim(None, 1, now=time.time()) == []
        await worker.run_until_idle(timeout=5)
    finally:
        await worker.stop(timeout=1)
    assert len(handler.calls) == 1
    assert await other.queue.job_counts() == {"queued": 0, "running": 0, "done": 1, "dead": 0}
