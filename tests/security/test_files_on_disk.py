"""The files on disk (issue 37, items 8 and 9): another local account reads nothing of
memory, and a clear leaves no copy of what it erased in memproxy's own files.

Actor: another account on the same machine, or whoever gets the data directory or a backup
later. Assets: every file under MEMPROXY_DATA_DIR (the database, its WAL and SHM, the spool,
Chroma's files, the per-user vector copies) and backups. The real app on a real socket, the
official SDK, real SQLite, PostgreSQL and Chroma; the umask is the process's own, set by the
test as an operator's shell would.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from memory.admin.backup import backup
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import memory_api
from tests.support.servers import PostgresServer
from tests.support.sql import query

ALICE = {"X-Memory-User-Id": "alice"}
FAST = {"job_backoff_seconds": 0.05, "job_outage_backoff_max_seconds": 0.3}


@pytest.fixture(params=[0o022, 0o000], ids=["umask 0022", "umask 0000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The process's umask for this test, put back after it."""
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def modes(root: Path) -> dict[str, int]:
    """Every directory and file under `root` (itself included) with its permission bits."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def too_open(root: Path) -> dict[str, str]:
    """What another account could reach: directories not 0700, files not 0600."""
    wrong = {}
    for name, mode in modes(root).items():
        path = root / name
        want = 0o700 if path.is_dir() else 0o600
        if mode != want:
            wrong[name] = oct(mode)
    return wrong


@pytest.mark.both_backends
def test_the_data_directory_is_0700_and_its_files_0600_whatever_the_umask(
    start_proxy: Callable[..., RunningProxy], umask: int, backend: str, tmp_path: Path,
) -> None:
    proxy = start_proxy(memory=True, vector_cache_mb=8)
    data: Path = proxy.state.settings.data_dir
    for i in range(3):
        said = f"The staging cluster number {i} is called kestrel-{i}."
        assert chat(proxy, said, session=f"s{i}", headers=ALICE).status == 200
    wait_for_jobs(proxy)
    names = set(modes(data))
    assert any("chroma" in n or n.startswith("vectors/") for n in names), names
    assert "spool.sqlite3" in names
    if backend == "sqlite":
        assert {"memproxy.db", "memproxy.db-wal", "memproxy.db-shm"} <= names
    assert too_open(data) == {}  # while it runs
    if backend == "sqlite":
        copy = tmp_path / "backups" / "monday"
        backup(proxy.state.settings.db_path, copy)
        assert stat.S_IMODE(copy.stat().st_mode) == 0o700
        assert stat.S_IMODE((copy / "memproxy.db").stat().st_mode) == 0o600
    proxy.stop()
    assert too_open(data) == {}  # and once it has closed everything


def test_an_existing_data_directory_that_others_can_read_is_warned_about(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o755)  # as an older memproxy, or a plain mkdir, left it
    proxy = start_proxy(memory=True, log_level="warning")
    assert chat(proxy, "hello", headers=ALICE).status == 200
    logged = capsys.readouterr().err
    assert "data directory" in logged and "0755" in logged and "chmod 700" in logged
    assert stat.S_IMODE(data.stat().st_mode) == 0o755  # the operator's choice is kept
    # Every file memproxy made in it is 0600 all the same.
    assert {n: m for n, m in too_open(data).items() if n != "."} == {}


def test_a_private_data_directory_is_not_warned_about(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    proxy = start_proxy(memory=True, log_level="warning")  # creates it: 0700
    assert chat(proxy, "hello", headers=ALICE).status == 200
    assert "data directory" not in capsys.readouterr().err
    assert stat.S_IMODE(proxy.state.settings.data_dir.stat().st_mode) == 0o700


# -- item 9: what a clear erases

TURN = "The vault combination is zebra-4815-quokka-1623 for the north door."
FACT = "User keeps the spare key under the blue ceramic heron on the porch."
SPOOLED = "The backup generator sits in hangar marmot-9044-walrus-7711 this week."


def on_disk(root: Path, *texts: str) -> list[tuple[str, str]]:
    """(text, file) for every file under `root` holding one of `texts`."""
    return [(t, str(p.relative_to(root))) for p in root.rglob("*") if p.is_file()
            for t in texts if t.encode() in p.read_bytes()]


def purged(proxy: RunningProxy, user: dict[str, str], timeout: float = 30) -> None:
    """Clear the user's memory and wait until the undo window has passed and its kept
    records are purged."""
    with memory_api(proxy, **user) as api:
        response = api.post("/clear", json={})
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + timeout
    while query(proxy.state.settings, "SELECT count(*) FROM clear_records")[0][0]:
        assert time.monotonic() < deadline, "the clear was not purged"
        time.sleep(0.1)
    wait_for_jobs(proxy)


@pytest.mark.both_backends
def test_a_purged_clear_leaves_no_turn_or_fact_text_in_the_data_directory(
    start_proxy: Callable[..., RunningProxy], backend: str,
) -> None:
    proxy = start_proxy(memory=True, clear_undo_seconds=1.0)
    data: Path = proxy.state.settings.data_dir
    assert chat(proxy, TURN, session="vault", headers=ALICE).status == 200
    with memory_api(proxy, **ALICE) as api:
        assert api.post("/facts", json={"text": FACT, "category": "context"}).status_code == 201
    wait_for_jobs(proxy)
    if backend == "sqlite":
        assert on_disk(data, TURN, FACT)  # the scan finds them while they are memory
    purged(proxy, ALICE)
    assert on_disk(data, TURN, FACT) == []
    proxy.stop()
    assert on_disk(data, TURN, FACT) == []


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own: stopping it touches no other test's database."""
    with PostgresServer() as server:
        yield server


def test_a_spooled_turn_replayed_then_purged_leaves_no_text_in_the_spool_files(
    start_proxy: Callable[..., RunningProxy], postgres: PostgresServer,
) -> None:
    proxy = start_proxy(memory=True, database_url=postgres.create_database(),
                        clear_undo_seconds=1.0, **FAST)
    data: Path = proxy.state.settings.data_dir
    try:
        postgres.stop()
        assert chat(proxy, SPOOLED, session="outage", headers=ALICE).status == 200
        time.sleep(0.3)  # the reply is spooled just after the response
        assert proxy.state.memory.spool_status()[0] == 2
        assert on_disk(data, SPOOLED)  # in spool.sqlite3 or its WAL
    finally:
        postgres.start()
    deadline = time.monotonic() + 30
    while proxy.state.memory.spool_status()[0]:
        assert time.monotonic() < deadline, "the spool was not replayed"
        time.sleep(0.05)
    wait_for_jobs(proxy, later=True)
    purged(proxy, ALICE)
    assert on_disk(data, SPOOLED) == []
    assert httpx.get(f"{proxy.url}/readyz", timeout=30).json()["status"] == "ok"
