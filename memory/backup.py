"""`memproxy backup`: a consistent copy of the memory, taken while the server runs.

The database is copied with SQLite's online backup API in a single step, so the copy is
the database exactly as one read transaction saw it; in WAL mode the server keeps writing
meanwhile and is never blocked.

The vector index is not copied. Chroma writes its HNSW segment files outside any SQLite
transaction, so a copy of its directory taken while the server indexes can be torn, and it
would in any case show a different moment than the database copy. Every vector is derived
from rows of the database, so the copy carries queued jobs that rebuild the index from the
copied rows themselves: the first server started on the copy re-embeds every chunk and
re-syncs every fact, summary and profile (lexical recall works while it does). Jobs the
server had queued or running at the moment of the copy are in the copy too, and run there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from memory.engine import INDEX_JOB
from memory.rebuild import queue_vector_rebuild
from memory.store import Store


class BackupError(Exception):
    """The backup could not be made; nothing was left at the destination."""


@dataclass(frozen=True)
class BackupResult:
    """What a backup wrote."""

    path: Path
    size: int
    turns: int
    rebuild_jobs: int
    seconds: float


def backup(source: Path, dest_dir: Path) -> BackupResult:
    """Copy the database at `source` into the data directory `dest_dir` (new or empty).

    Runs its own event loop (the copy is opened with the store's own code): call it from
    synchronous code, or in a worker thread.
    """
    started = time.perf_counter()
    if not source.is_file():
        raise BackupError(f"no memproxy database at {source}")
    target = dest_dir / source.name
    if target.exists():
        raise BackupError(f"{target} already exists; back up into a new directory")
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    _remove(partial)
    try:
        _copy(source, partial)
        _check(partial)
        turns, jobs = asyncio.run(_queue_rebuild(partial))
        leftovers = [p for p in _sidecars(partial) if p.exists()]
        if leftovers:
            raise BackupError(f"the copy was not closed cleanly: {leftovers[0]} remains")
        _fsync(partial)
        os.replace(partial, target)
    except BaseException:
        _remove(partial)
        raise
    return BackupResult(target, target.stat().st_size, turns, jobs,
                        time.perf_counter() - started)


def _copy(source: Path, partial: Path) -> None:
    # pages=-1: all pages in one step, under one read transaction, hence one moment. Copied
    # in steps, a write by the server between two steps would restart the copy.
    with closing(sqlite3.connect(source, timeout=30)) as src, \
            closing(sqlite3.connect(partial)) as dst:
        src.backup(dst, pages=-1)


def _check(path: Path) -> None:
    with closing(sqlite3.connect(path)) as conn:
        result = [row[0] for row in conn.execute("PRAGMA integrity_check")]
    if result != ["ok"]:
        raise BackupError(f"the copy failed its integrity check: {'; '.join(result[:5])}")


async def _queue_rebuild(path: Path) -> tuple[int, int]:
    """Queue the jobs that rebuild the vectors of everything in the copy; (turns, jobs)."""
    store = await Store.open(path)
    try:
        turns = (await store.read("SELECT COUNT(*) FROM turns"))[0][0]
        # Turns not chunked yet have their own index jobs in the copy.
        jobs = await queue_vector_rebuild(
            store, index_job=INDEX_JOB,
            turns_sql="SELECT DISTINCT turn_id FROM chunks ORDER BY turn_id",
        )
    finally:
        await store.close()
    return int(turns), len(jobs)


def _sidecars(path: Path) -> list[Path]:
    return [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


def _remove(path: Path) -> None:
    for each in (path, *_sidecars(path)):
        with contextlib.suppress(FileNotFoundError):
            each.unlink()


def _fsync(path: Path) -> None:
    with path.open("rb") as file:
        os.fsync(file.fileno())
