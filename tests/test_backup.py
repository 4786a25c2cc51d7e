"""`memproxy backup`: a consistent copy of a running server's memory, usable by a new server."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.cli.main import main
from tests.conftest import ROOT, RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET

TURN_COLUMNS = "id, user_id, session_id, parent_id, position, role, content, content_hash"


def run_backup(proxy: RunningProxy, dest: Path) -> subprocess.CompletedProcess[str]:
    """The real command line, in its own process, against the proxy's data directory."""
    env = {**os.environ, "MEMPROXY_DATA_DIR": str(proxy.state.settings.data_dir)}
    return subprocess.run([sys.executable, "-m", "proxy", "backup", str(dest)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


class Writer(threading.Thread):
    """Keeps chatting (new turns, index jobs) until stopped."""

    def __init__(self, proxy: RunningProxy) -> None:
        super().__init__(daemon=True)
        self.proxy, self.sent, self.stop = proxy, 0, threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                user = f"writer{self.sent % 3}"
                chat(self.proxy, f"Writer note {self.sent}: the build cache lives in bucket"
                     f" b{self.sent}.", user=user, session=f"{user}-s")
                self.sent += 1
        except BaseException as exc:  # surfaced by the test
            self.error = exc


def test_backup_while_writing_gives_a_copy_a_new_server_recalls_from(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path
) -> None:
    source = start_proxy(memory=True, **QUIET)
    chat(source, "The lighthouse keeper on our island is named Bartholomew Quince.",
         user="ada", session="ada-s")
    fact = httpx.post(f"{source.url}/v1/memory/facts", headers={"X-Memory-User-Id": "ada"},
                      json={"text": "Ada's cat is called Marzipan", "category": "identity"})
    assert fact.status_code == 201, fact.text
    wait_for_jobs(source)
    writer = Writer(source)
    writer.start()
    while writer.sent < 5 and writer.is_alive():
        threading.Event().wait(0.05)
    dest = tmp_path / "copy"
    done = run_backup(source, dest)
    sent_during = writer.sent
    while writer.sent < sent_during + 5 and writer.is_alive():
        threading.Event().wait(0.05)
    writer.stop.set()
    writer.join(60)
    assert writer.error is None, writer.error
    assert done.returncode == 0, done.stderr
    assert "Backed up" in done.stdout and "queued jobs" in done.stdout, done.stdout
    print(f"\nbackup: {done.stdout.strip()}; {writer.sent} chats written meanwhile")
    wait_for_jobs(source)

    copy = dest / "memproxy.db"
    assert sorted(p.name for p in dest.iterdir()) == ["memproxy.db"]  # no partial, no WAL
    assert rows(copy, "PRAGMA integrity_check") == [("ok",)]
    # One moment of the source: its turns up to some id, identical, and nothing else.
    copied = rows(copy, f"SELECT {TURN_COLUMNS} FROM turns ORDER BY id")
    last = copied[-1][0]
    original = rows(source.state.settings.db_path,
                    f"SELECT {TURN_COLUMNS} FROM turns WHERE id <= {last} ORDER BY id")
    assert copied == original
    assert any(r[1] == "ada" for r in copied) and any(r[1] == "writer0" for r in copied)
    assert len(copied) < rows(source.state.settings.db_path, "SELECT COUNT(*) FROM turns")[0][0]

    restored = start_proxy(memory=True, data_dir=dest, weight_bm25=0.0, **QUIET)
    wait_for_jobs(restored)
    memory = restored.state.memory
    chunks = rows(copy, "SELECT COUNT(*) FROM chunks")[0][0]
    facts = rows(copy, "SELECT COUNT(*) FROM facts WHERE valid_to IS NULL")[0][0]
    assert memory.vectors.count() == chunks + facts  # every chunk and fact: one vector
    assert memory.vectors.count({"user_id": "ada"}) == source.state.memory.vectors.count(
        {"user_id": "ada"})
    with httpx.Client(base_url=f"{restored.url}/v1/memory", timeout=60,
                      headers={"X-Memory-User-Id": "ada"}) as api:
        # Dense only (BM25 weighs 0): found through the rebuilt vector index.
        found = api.post("/search", json={"query": "Who keeps the lighthouse?"}).json()
        assert "Bartholomew Quince" in found["block"], found
        assert any(i["signals"].get("dense", 0) > 0 for i in found["items"]), found["items"]
        cat = api.post("/search", json={"query": "What is the name of my cat?"}).json()
        assert "Marzipan" in cat["block"], cat
    jobs = rows(copy, "SELECT status, COUNT(*) FROM jobs GROUP BY status")
    assert dict(jobs).keys() <= {"done"}, jobs  # every job, copied or rebuild, completed


def test_backup_refuses_an_existing_copy_and_a_missing_database(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = start_proxy(memory=True, **QUIET)
    chat(source, "hello there", user="ada", session="ada-s")
    monkeypatch.setenv("MEMPROXY_DATA_DIR", str(source.state.settings.data_dir))
    dest = tmp_path / "copy"
    assert main(["backup", str(dest)]) == 0
    before = (dest / "memproxy.db").read_bytes()
    assert main(["backup", str(dest)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (dest / "memproxy.db").read_bytes() == before
    monkeypatch.setenv("MEMPROXY_DATA_DIR", str(tmp_path / "nothing-here"))
    assert main(["backup", str(tmp_path / "c2")]) == 1
    assert "no memproxy database" in capsys.readouterr().err
    assert not (tmp_path / "c2" / "memproxy.db").exists()
    monkeypatch.setenv("MEMPROXY_DATABASE_URL", "postgresql://db.invalid/memproxy")
    assert main(["backup", str(tmp_path / "c3")]) == 1
    assert "pg_dump" in capsys.readouterr().err and not (tmp_path / "c3").exists()
