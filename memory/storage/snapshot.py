"""A consistent copy of the database file, taken while the server writes (memory.admin.backup).

SQLite's online backup API copies every page in a single step, so the copy is the database
exactly as one read transaction saw it; in WAL mode the server keeps writing meanwhile and is
never blocked.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from memory.storage.file_modes import SQLITE_SIDECARS, private_database


def copy_database(source: Path, dest: Path) -> None:
    """Copy the database at `source` into the new file `dest`."""
    # pages=-1: all pages in one step, under one read transaction, hence one moment. Copied
    # in steps, a write by the server between two steps would restart the copy.
    private_database(dest)  # a copy of memory is 0600 whatever the umask (file_modes.py)
    with closing(sqlite3.connect(source, timeout=30)) as src, \
            closing(sqlite3.connect(dest)) as dst:
        src.backup(dst, pages=-1)


def integrity_problems(path: Path) -> list[str]:
    """What SQLite's integrity check finds wrong with the file ([] when it is sound)."""
    with closing(sqlite3.connect(path)) as conn:
        result = [str(row[0]) for row in conn.execute("PRAGMA integrity_check")]
    return [] if result == ["ok"] else result


def sidecars(path: Path) -> list[Path]:
    """The files SQLite keeps next to a database while it is open."""
    return [path.with_name(path.name + suffix) for suffix in SQLITE_SIDECARS]
