"""`memproxy backup`: a consistent copy of the memory, taken while the server runs.

The database is copied with SQLite's online backup API in a single step (storage/snapshot.py),
so the copy is the database exactly as one read transaction saw it; in WAL mode the server
keeps writing meanwhile and is never blocked.

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
import time
from dataclasses import dataclass
from pathlib import Path

from memory.index.rebuild import queue_vector_rebuild
from memory.log.turn_log import INDEX_JOB
from memory.storage import turns
from memory.storage.database import DatabaseError, SQLiteDatabase
from memory.storage.file_modes import private_dir
from memory.storage.snapshot import copy_database, integrity_problems, sidecars


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

    Runs its own event loop (the copy is opened with the storage layer's own code): call it
    from synchronous code, or in a worker thread.
    """
    started = time.perf_counter()
    if not source.is_file():
        raise BackupError(f"no memproxy database at {source}")
    target = dest_dir / source.name
    if target.exists():
        raise BackupError(f"{target} already exists; back up into a new directory")
    private_dir(dest_dir)  # a backup is memory: 0700 and 0600 (storage/file_modes.py)
    partial = target.with_name(target.name + ".partial")
    _remove(partial)
    try:
        copy_database(source, partial)
        if problems := integrity_problems(partial):
            raise BackupError(f"the copy failed its integrity check: {'; '.join(problems[:5])}")
        turn_count, job_count = asyncio.run(_queue_rebuild(partial))
        if leftovers := [p for p in sidecars(partial) if p.exists()]:
            raise BackupError(f"the copy was not closed cleanly: {leftovers[0]} remains")
        _fsync(partial)
        os.replace(partial, target)
    except BaseException as exc:
        _remove(partial)
        if isinstance(exc, DatabaseError):  # a corrupt or unreadable source, a full disk
            raise BackupError(str(exc)) from exc
        raise
    return BackupResult(target, target.stat().st_size, turn_count, job_count,
                        time.perf_counter() - started)


async def _queue_rebuild(path: Path) -> tuple[int, int]:
    """Queue the jobs that rebuild the vectors of everything in the copy; (turns, jobs)."""
    db = await SQLiteDatabase.open(path)
    try:
        turn_count = await turns.count(db)
        # Turns not chunked yet have their own index jobs in the copy.
        queued = await queue_vector_rebuild(
            db, index_job=INDEX_JOB, turn_ids=await turns.chunked_turn_ids(db)
        )
    finally:
        await db.close()
    return turn_count, len(queued)


def _remove(path: Path) -> None:
    for each in (path, *sidecars(path)):
        with contextlib.suppress(FileNotFoundError):
            each.unlink()


def _fsync(path: Path) -> None:
    with path.open("rb") as file:
        os.fsync(file.fileno())
