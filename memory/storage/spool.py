"""Table `spooled`, in a file of its own (data_dir/spool.sqlite3): writes of turns the memory
database could not take, kept until they are replayed into it (memory.log.spooling).

The file is local to one process: it is what lets a replica answer through a database
outage without losing what it answered. Each entry is committed with `synchronous=FULL`
(fsynced) before `put` returns, the same durability a turn has once stored. Entries are
replayed in the order they were put; one that the database refuses for a reason of its own
is set aside (`failed_at`), kept in the file for an operator, and no longer counted.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory.storage.file_modes import private_database

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spooled (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    turns INTEGER NOT NULL,  -- how many of its turns no earlier entry holds
    entry TEXT NOT NULL,
    failed_at REAL,
    error TEXT
)
"""


class SpoolFull(Exception):
    """An entry that does not fit: the spool's bound, or its user's share, is reached."""


@dataclass(frozen=True, slots=True)
class SpooledEntry:
    """One write waiting for the database: `entry` is what memory.log.spooling put."""

    id: int
    created_at: float
    user_id: str
    session_id: str
    turns: int
    entry: dict[str, Any]


class SpoolFile:
    """The spool's SQLite file; the depth (turns waiting) and the oldest entry's time are
    kept in memory, so asking for them costs nothing."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path
        self._lock = threading.Lock()  # one statement at a time on the one connection
        self.by_user: dict[str, int] = {}  # turns waiting, per user
        self.depth, self.oldest = self._totals()

    @classmethod
    async def open(cls, path: Path) -> SpoolFile:
        """Open (creating if needed) the spool file at `path`."""
        return await asyncio.to_thread(cls._open, path)

    @classmethod
    def _open(cls, path: Path) -> SpoolFile:
        private_database(path)  # 0600, its WAL too (memory/storage/file_modes.py)
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # a commit is on the disk when put() returns
        conn.execute("PRAGMA secure_delete=ON")  # a replayed entry's text is zeroed, not freed
        conn.execute(_SCHEMA)
        return cls(conn, path)

    def _totals(self) -> tuple[int, float | None]:
        rows = self._conn.execute(
            "SELECT user_id, SUM(turns), MIN(created_at) FROM spooled WHERE failed_at IS NULL"
            " GROUP BY user_id"
        ).fetchall()
        self.by_user = {str(r[0]): int(r[1]) for r in rows if r[1]}
        oldest = min((r[2] for r in rows), default=None)
        return sum(self.by_user.values()), oldest

    async def put(
        self, user_id: str, session_id: str, turns: int, entry: dict[str, Any], *,
        room: tuple[int, int] | None = None, need: int | None = None,
    ) -> int:
        """Append an entry, committed and fsynced; return its id.

        `room`: (the spool's bound, one user's share). The entry goes in only when `need`
        more turns (default `turns`) fit under both, checked and counted under one lock so
        concurrent puts cannot pass a bound together; SpoolFull otherwise."""
        now = time.time()
        text = json.dumps(entry)

        def insert() -> int:
            with self._lock:
                if room is not None:
                    self._check_room(user_id, turns if need is None else need, *room)
                cursor = self._conn.execute(
                    "INSERT INTO spooled (created_at, user_id, session_id, turns, entry)"
                    " VALUES (?, ?, ?, ?, ?)", (now, user_id, session_id, turns, text),
                )
                self.depth += turns
                self.by_user[user_id] = self.by_user.get(user_id, 0) + turns
                self.oldest = now if self.oldest is None else self.oldest
                return int(cursor.lastrowid or 0)

        return await asyncio.to_thread(insert)

    def _check_room(self, user_id: str, need: int, bound: int, share: int) -> None:
        held = self.by_user.get(user_id, 0)
        if need > 0 and (self.depth + need > bound or held + need > share):
            raise SpoolFull(
                f"{need} turn(s) do not fit in the spool ({self.depth} of {bound} waiting, "
                f"{held} of this user's {share}): not remembered"
            )

    async def first(self) -> SpooledEntry | None:
        """The oldest entry still waiting, if any."""
        return next(iter(await self._select(" ORDER BY id LIMIT 1", ())), None)

    async def of_session(self, user_id: str, session_id: str) -> list[SpooledEntry]:
        """The entries of one session still waiting, oldest first."""
        return await self._select(
            " AND user_id = ? AND session_id = ? ORDER BY id", (user_id, session_id)
        )

    async def remove(self, entry: SpooledEntry) -> None:
        """Drop an entry the database now holds."""
        await asyncio.to_thread(self._settle, "DELETE FROM spooled WHERE id = ?", (entry.id,))

    async def set_aside(self, entry: SpooledEntry, error: str) -> None:
        """Keep an entry the database refused for a reason of its own, no longer waiting."""
        await asyncio.to_thread(
            self._settle, "UPDATE spooled SET failed_at = ?, error = ? WHERE id = ?",
            (time.time(), error[:4000], entry.id),
        )

    def _settle(self, sql: str, params: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.execute(sql, params)
            self.depth, self.oldest = self._totals()
            if self.depth == 0:
                # Replayed: the turns are the database's now, and a clear there must not
                # leave them in this file's WAL (docs/security.md, what a clear erases).
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    async def _select(self, where: str, params: tuple[Any, ...]) -> list[SpooledEntry]:
        def select() -> list[SpooledEntry]:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT id, created_at, user_id, session_id, turns, entry FROM spooled"
                    " WHERE failed_at IS NULL" + where, params,
                ).fetchall()
            return [SpooledEntry(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

        return await asyncio.to_thread(select)

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._conn.close()
