"""Backing services that blink under load (issue 28): PostgreSQL restarted in the middle of
chats through two replicas loses and duplicates no answered turn and fails no request, and
every index job ends done; a Chroma server down for longer than the jobs' whole retry budget
buries nothing, and afterwards every turn is found by meaning.

Timings are made small so each test runs in about 20-30 s: attempts 2 and a first backoff of
0.2 s give a retry budget of well under a second (by today's rules the jobs would be dead
after it); the outages last several seconds, and jobs retry at most every second
(job_outage_backoff_max_seconds) while they last.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from config import Settings
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.processes import Process, launch, memproxy_env, wait_ready
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.servers import ChromaServer, PostgresServer
from tests.support.sql import query

pytestmark = [pytest.mark.replicas, pytest.mark.postgres]

SESSIONS, TURNS = 4, 8
SMALL_BUDGET: dict[str, int | float] = {
    "job_max_attempts": 2, "job_backoff_seconds": 0.2, "job_outage_backoff_max_seconds": 1.0,
}


@dataclass
class Load:
    """Chat sessions resending their history round robin over the replicas; every request
    must be answered (no retry to another replica)."""

    urls: list[str]
    user: str
    pause: float = 0.15
    accepted: list[tuple[str, str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    degraded: int = 0
    _turn: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def session(self, number: int) -> None:
        session, history = f"s{number}", list[dict[str, str]]()
        with httpx.Client(timeout=60, trust_env=False) as http:
            for turn in range(TURNS):
                said = f"Session {number} note {turn}: service s{number}x{turn} runs on host h{turn}."
                history.append({"role": "user", "content": said})
                with self._lock:
                    url = self.urls[next(self._turn) % len(self.urls)]
                try:
                    response = http.post(
                        f"{url}/v1/chat/completions",
                        json={"model": "gpt-4o", "messages": history},
                        headers={"X-Memory-User-Id": self.user, "X-Memory-Session-Id": session},
                    )
                except httpx.TransportError as exc:
                    with self._lock:
                        self.failed.append(f"{url}: {exc!r}")
                    return
                if response.status_code != 200:
                    with self._lock:
                        self.failed.append(f"{url}: {response.status_code} {response.text[:200]}")
                    return
                reply = str(response.json()["choices"][0]["message"]["content"])
                history.append({"role": "assistant", "content": reply})
                with self._lock:
                    self.degraded += "x-memory-error" in response.headers
                    self.accepted += [(session, "user", said), (session, "assistant", reply)]
                time.sleep(self.pause)


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture
def two_replicas(
    upstream: ScriptedUpstream, postgres: PostgresServer, chroma_server: ChromaServer,
    tmp_path: Path,
) -> Iterator[tuple[Settings, list[Process]]]:
    database = Settings(database_url=postgres.create_database())
    shared = {"database_url": str(database.database_url), "chroma_url": chroma_server.url,
              "log_level": "warning", **{k: str(v) for k, v in SMALL_BUDGET.items()}}
    processes = [launch(memproxy_env(upstream.base_url, **shared), tmp_path / f"data-{n}",
                        tmp_path / f"log-{n}") for n in range(2)]
    try:
        for process in processes:
            wait_ready(process)
        yield database, processes
    finally:
        for process in processes:
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait(10)


def test_a_postgresql_restart_under_load_loses_duplicates_and_fails_nothing(
    two_replicas: tuple[Settings, list[Process]], postgres: PostgresServer,
) -> None:
    database, processes = two_replicas
    load = Load([process.url for process in processes], user="pg-restart")
    sessions = [threading.Thread(target=load.session, args=(n,), daemon=True)
                for n in range(SESSIONS)]
    for thread in sessions:
        thread.start()
    time.sleep(1.5)  # a few turns of every session are stored first
    postgres.restart(down_seconds=3)  # fast shutdown: every connection is cut
    for thread in sessions:
        thread.join(120)
        assert not thread.is_alive()
    assert load.failed == [], "\n".join(process.output() for process in processes)
    for process in processes:  # both spools replayed
        deadline = time.monotonic() + 60
        while httpx.get(f"{process.url}/readyz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{process.url}/readyz").text
            time.sleep(0.2)
    counts = wait_for_jobs(database, later=True, timeout=60)
    # Every turn a client saw accepted is stored exactly once, and nothing else is.
    assert len(load.accepted) == 2 * SESSIONS * TURNS
    stored = query(database, "SELECT session_id, role, content FROM turns WHERE user_id = ?"
                             " ORDER BY id", (load.user,))
    assert sorted(stored) == sorted(load.accepted)
    assert set(counts) == {"done"}, counts  # every index job ended done
    print(f"\nPostgreSQL restart under load: {len(stored)} turns stored once, "
          f"{load.degraded} answered with X-Memory-Error, 0 failed")


def test_a_chroma_server_down_longer_than_the_retry_budget_buries_no_job(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    with ChromaServer() as chroma:
        proxy = start_proxy(memory=True, chroma_url=chroma.url, **SMALL_BUDGET)
        settings: Settings = proxy.state.settings
        facts = [f"The {name} service is deployed in region {region}." for name, region in
                 [("billing", "eu-west-3"), ("search", "ap-south-1"), ("mailer", "us-east-2")]]
        chroma.kill()
        down = time.monotonic()
        for n, fact in enumerate(facts):
            assert chat(proxy, fact, session=f"c{n}", user="dee").status == 200
        time.sleep(max(0.0, 8 - (time.monotonic() - down)))  # 8 s: ten retry budgets
        jobs = query(settings, "SELECT status, attempts, max_attempts FROM jobs")
        assert {status for status, _, _ in jobs} <= {"queued", "running"}, jobs
        assert all(attempts > 2 for _, attempts, _ in jobs), jobs  # past the old budget
        chroma.start()
        counts = wait_for_jobs(proxy, later=True, timeout=60)
        assert counts == {"done": 2 * len(facts)}, counts
        # Found by meaning: the dense index holds every turn's chunk again.
        for fact in facts:
            name = fact.split()[1]
            dry = httpx.post(f"{proxy.base_url}/chat/completions", timeout=30, headers={
                "X-Memory-User-Id": "dee", "X-Memory-Dry-Run": "on", "X-Memory-Write": "off",
            }, json={"model": "gpt-4o", "messages": [
                {"role": "user", "content": f"Where does {name} run?"}]})
            assert fact in dry.json()["block"], dry.json()
        assert proxy.state.memory.vectors.count({"user_id": "dee"}) >= 2 * len(facts)
