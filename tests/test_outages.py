"""Outages are waited out, not counted (issue 28): a job whose attempt failed because
PostgreSQL, Chroma or the upstream did not answer keeps its attempts and runs once the service
answers; only errors of the job itself lead to the dead letters; settling a job waits for the
database. Each source of an outage is mapped to `memory.outages.Unavailable` where it is
raised: a real PostgreSQL stopped and started, a real Chroma server killed, a real upstream
that is not listening."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config import Settings
from memory.index.vectors import VectorIndex
from memory.jobs.worker import JobWorker
from memory.outages import Unavailable, is_outage
from memory.storage import jobs
from proxy.upstream.client import Upstream
from proxy.upstream.llm_client import LearningCallFailed, LearningUpstreamUnavailable, LLMClient
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream
from tests.support.servers import ChromaServer, PostgresServer, free_port
from tests.support.storage import Storage


def _sqlite_busy() -> sqlite3.OperationalError:
    """A real "database is locked" error, raised by SQLite itself."""
    path = Path(f"/tmp/memproxy-busy-{time.time_ns()}.db")
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        other = sqlite3.connect(path, timeout=0)
        try:
            other.execute("SELECT 1 FROM sqlite_master")
        except sqlite3.OperationalError as exc:
            return exc
        finally:
            other.close()
    finally:
        holder.close()
        path.unlink()
    raise AssertionError("SQLite did not refuse the locked file")


def _wrapped() -> Exception:
    try:
        raise Unavailable("Chroma", "connection refused")
    except Unavailable as cause:
        try:
            raise RuntimeError("indexing failed") from cause
        except RuntimeError as exc:
            return exc


OUTAGES: dict[str, Callable[[], BaseException]] = {
    "unavailable": lambda: Unavailable("PostgreSQL", "connection refused"),
    "refused": lambda: ConnectionRefusedError(111, "Connection refused"),
    "reset": lambda: ConnectionResetError(104, "Connection reset by peer"),
    "timeout": lambda: TimeoutError("timed out"),
    "sqlite-locked": _sqlite_busy,
    "raised-from-an-outage": _wrapped,
}


@pytest.mark.parametrize("name", sorted(OUTAGES))
def test_the_table_calls_each_outage_an_outage(name: str) -> None:
    assert is_outage(OUTAGES[name]())


@pytest.mark.parametrize("error", [
    ValueError("bad payload"), FileNotFoundError(2, "no such file"), KeyError("turn_ids"),
    sqlite3.IntegrityError("UNIQUE constraint failed"), RuntimeError("model reply unusable"),
])
def test_errors_of_the_job_itself_are_not_outages(error: Exception) -> None:
    assert not is_outage(error)


class Flaky:
    """A handler failing its first `failures` calls with a fresh outage each time."""

    def __init__(self, failures: int, error: Callable[[], BaseException]) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    async def __call__(self, payload: Any) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error()


@pytest.fixture
async def store(tmp_path: Path, database_url: str | None) -> AsyncIterator[Storage]:
    store = await Storage.open(tmp_path / "memory.db", url=database_url)
    yield store
    await store.close()


@pytest.mark.both_backends
@pytest.mark.parametrize("name", ["unavailable", "refused", "sqlite-locked", "raised-from-an-outage"])
async def test_an_outage_longer_than_every_attempt_does_not_bury_the_job(
    store: Storage, name: str
) -> None:
    handler = Flaky(failures=8, error=OUTAGES[name])
    worker = JobWorker(store.queue, {"index": handler}, poll_interval=0.05, backoff_base=0.01,
                       outage_backoff_max=0.02)
    job_id = await store.queue.enqueue("index", {"n": 1}, max_attempts=3)
    await worker.start()
    try:
        await worker.run_until_idle(timeout=20)
    finally:
        await worker.stop(timeout=1)
    assert handler.calls == 9
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 1, "dead": 0}
    rows = await store.db.fetch("SELECT attempts, max_attempts FROM jobs WHERE id = ?", (job_id,))
    attempts, max_attempts = rows[0]
    assert (attempts, max_attempts - attempts) == (9, 2)  # the 3 it had, less the one that worked


@pytest.mark.both_backends
async def test_an_error_of_the_job_itself_still_spends_attempts(store: Storage) -> None:
    handler = Flaky(failures=8, error=lambda: ValueError("bad payload"))
    worker = JobWorker(store.queue, {"index": handler}, poll_interval=0.05, backoff_base=0.01)
    await store.queue.enqueue("index", {"n": 1}, max_attempts=3)
    await worker.start()
    try:
        await worker.run_until_idle(timeout=20)
    finally:
        await worker.stop(timeout=1)
    assert handler.calls == 3
    assert (await store.queue.job_counts())["dead"] == 1


@pytest.mark.both_backends
async def test_a_batch_that_meets_an_outage_is_retried_without_spending_attempts(
    store: Storage,
) -> None:
    calls: list[int] = []

    async def batch(payloads: list[dict[str, Any]]) -> None:
        calls.append(len(payloads))
        if len(calls) <= 1:
            raise Unavailable("Chroma", "connection refused")

    async def single(payload: dict[str, Any]) -> None:
        calls.append(1)
        if len(calls) <= 4:
            raise Unavailable("Chroma", "connection refused")

    worker = JobWorker(store.queue, {"index": single}, batch_handlers={"index": batch},
                       batch_size=8, poll_interval=0.05, backoff_base=0.01,
                       outage_backoff_max=0.02)
    for n in range(3):
        await store.queue.enqueue("index", {"n": n}, max_attempts=1)
    await worker.start()
    try:
        await worker.run_until_idle(timeout=20)
    finally:
        await worker.stop(timeout=1)
    # Their only attempt met the outage twice (batch, then alone), and still nothing is dead.
    assert calls[0] == 3
    assert await store.queue.job_counts() == {"queued": 0, "running": 0, "done": 3, "dead": 0}


@pytest.mark.postgres
async def test_a_job_that_finishes_while_postgresql_is_down_is_settled_once_it_is_back(
    tmp_path: Path,
) -> None:
    with PostgresServer() as server:
        store = await Storage.open(tmp_path / "unused.db", url=server.create_database())
        started, finish = asyncio.Event(), asyncio.Event()

        async def handler(payload: dict[str, Any]) -> None:
            started.set()
            await finish.wait()

        worker = JobWorker(store.queue, {"index": handler}, poll_interval=0.05,
                           backoff_base=0.05, outage_backoff_max=0.2)
        try:
            await store.queue.enqueue("index", {"n": 1}, max_attempts=1)
            await worker.start()
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.to_thread(server.stop)
            finish.set()  # its settlement meets a stopped server
            await asyncio.sleep(1.0)
            await asyncio.to_thread(server.start)
            await worker.run_until_idle(timeout=20)
            counts = await store.queue.job_counts()
        finally:
            await worker.stop(timeout=1)
            await store.close()
    assert counts == {"queued": 0, "running": 0, "done": 1, "dead": 0}


@pytest.mark.postgres
async def test_the_pool_recovers_at_once_after_a_postgresql_restart(tmp_path: Path) -> None:
    with PostgresServer() as server:
        store = await Storage.open(tmp_path / "unused.db", url=server.create_database(),
                                   readers=4)
        try:
            # Every pooled connection is opened before the restart, so every one is stale.
            async def hold() -> None:
                async with store.db.autocommit() as tx:
                    await tx.fetch("SELECT pg_sleep(0.05)")
            for statement in ("read", "write", "autocommit"):
                await asyncio.gather(*(hold() for _ in range(4)))
                # Restarted while the event loop is busy (blocked here): the pool has not
                # seen its connections close when the next statement takes one.
                server.restart()
                # Not one statement fails once the server accepts connections again.
                if statement == "read":
                    assert (await store.db.fetch("SELECT 1"))[0][0] == 1
                elif statement == "write":
                    async with store.db.write() as tx:
                        await jobs.enqueue(tx, "index", {"n": 1})
                else:
                    async with store.db.autocommit() as tx:
                        await jobs.enqueue(tx, "index", {"n": 2})
            assert (await store.queue.job_counts())["queued"] == 2
            await asyncio.to_thread(server.stop)
            with pytest.raises(Unavailable):
                await store.db.fetch("SELECT 1")
            with pytest.raises(Unavailable):
                async with store.db.write() as tx:
                    await tx.fetch("SELECT 1")
            await asyncio.to_thread(server.start)
            assert (await store.db.fetch("SELECT 1"))[0][0] == 1
        finally:
            await store.close()


async def test_a_chroma_server_that_is_down_raises_unavailable() -> None:
    with ChromaServer() as chroma:
        index = await asyncio.to_thread(VectorIndex.connect, chroma.url, "outage")
        vector = np.ones((1, 384), dtype=np.float32) / np.sqrt(384)
        try:
            chroma.kill()
            with pytest.raises(Unavailable) as raised:
                await asyncio.to_thread(index.add, ["1"], vector, [{"user_id": "u"}])
            assert raised.value.service == "Chroma"
            await asyncio.to_thread(chroma.start)
            await asyncio.to_thread(index.add, ["1"], vector, [{"user_id": "u"}])
            assert await asyncio.to_thread(index.count) == 1
        finally:
            await asyncio.to_thread(index.close)


async def test_the_learning_client_calls_an_unreachable_upstream_an_outage() -> None:
    settings = Settings(upstream_base_url=f"http://127.0.0.1:{free_port()}", upstream_retries=0)
    upstream = Upstream(settings)
    try:
        with pytest.raises(LearningUpstreamUnavailable) as raised:
            await LLMClient(settings, upstream)("gpt-4o", [{"role": "user", "content": "x"}],
                                                user_id="u")
        assert is_outage(raised.value) and isinstance(raised.value, LearningCallFailed)
    finally:
        await upstream.aclose()


@pytest.mark.parametrize(("status", "outage"), [(503, True), (502, True), (504, True),
                                                (400, False), (401, False), (500, False)])
async def test_the_learning_client_calls_a_gateways_down_status_an_outage(
    upstream: ScriptedUpstream, status: int, outage: bool
) -> None:
    upstream.enqueue(JSONReply({"error": {"message": "no"}}, status=status))
    settings = Settings(upstream_base_url=upstream.base_url, upstream_retries=0)
    client = Upstream(settings)
    try:
        with pytest.raises(LearningCallFailed) as raised:
            await LLMClient(settings, client)("gpt-4o", [{"role": "user", "content": "x"}],
                                              user_id="u")
        assert is_outage(raised.value) is outage
    finally:
        await client.aclose()
