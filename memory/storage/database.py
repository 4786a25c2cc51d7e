"""The SQLite implementation of the database interface (`memory.storage.interface`): one
serialized writer, round-robin readers; the only aiosqlite user.

One writer connection takes every write, serialized by an asyncio.Lock so a multi-statement
transaction is never interleaved with another coroutine's statements (Datasette's write
queue); read-only connections serve queries. Write transactions use BEGIN IMMEDIATE, so they
also exclude writers in other processes.

The table modules next to this one (turns, sessions, jobs, metrics, facts, summaries,
profiles, clears) hold all of the SQL, as functions that take a `Connection`: the Database
itself for a read on a reader connection, or the `Transaction` of a write. Everything
dialect-specific (placeholders, FTS5, RETURNING, json_each) stays inside this package: the
SQL is written for SQLite, `memory.storage.postgres` runs it on PostgreSQL, and where the two
truly differ a table function switches on `conn.dialect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sqlite3
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from memory.storage import migrations
from memory.storage.file_modes import private_database
from memory.storage.interface import Connection as Connection
from memory.storage.interface import Database as Database
from memory.storage.interface import Dialect as Dialect
from memory.storage.interface import Row as Row
from memory.storage.interface import Transaction as Transaction

_BUSY_TIMEOUT_MS = 5000
_LOCKED_ATTEMPTS = 6  # each waits the busy timeout: 30 s in all for a write lock
_T = TypeVar("_T")
# SQLite's default limit on bound parameters is 32766; stay far below it.
IN_BATCH = 500
DatabaseError = sqlite3.Error  # what a statement the database refuses raises
async def open_database(url: str | None, path: Path) -> Database:
    """PostgreSQL at `url` when one is given, else the SQLite file at `path`."""
    if url:
        from memory.storage.postgres import PostgresDatabase  # asyncpg only when asked for

        return await PostgresDatabase.open(url)
    return await SQLiteDatabase.open(path)


class SQLiteTransaction:
    """Statements of one write, which holds the writer until it ends."""

    dialect: Dialect = "sqlite"

    def __init__(self, db: aiosqlite.Connection, *, retry_locked: bool = False) -> None:
        self._db = db
        # Outside BEGIN IMMEDIATE each statement takes the file's write lock on its own.
        self._retry_locked = retry_locked

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement and return its rows (RETURNING rows, or none)."""
        return list(await self._run(lambda: self._db.execute_fetchall(sql, params)))

    async def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one INSERT/UPDATE/DELETE and return how many rows it changed."""
        cursor = await self._run(lambda: self._db.execute(sql, params))
        async with cursor:
            return cursor.rowcount

    async def change_many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""
        await self._run(lambda: self._db.executemany(sql, rows))

    async def _run(self, statement: Callable[[], Awaitable[_T]]) -> _T:
        return await (_when_unlocked(statement) if self._retry_locked else statement())


class SQLiteDatabase:
    """The memory database in a SQLite file: one serialized writer, round-robin readers."""

    dialect: Dialect = "sqlite"

    def __init__(
        self, path: Path, writer: aiosqlite.Connection, readers: list[aiosqlite.Connection]
    ) -> None:
        self.path = path
        self._writer = writer
        self._readers = readers
        self._next_reader = itertools.cycle(range(len(readers)))
        self._write_lock = asyncio.Lock()
        # A key's lock lives while a holder or waiter refers to it, then leaves the map.
        self._held: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    @classmethod
    async def open(cls, path: Path, *, readers: int = 4) -> SQLiteDatabase:
        """Create or upgrade the database at `path` and open its connections."""
        if readers < 1:
            raise ValueError("a database needs at least one reader connection")
        await asyncio.to_thread(private_database, path)  # 0600, its WAL too (file_modes.py)
        read_only_uri = await asyncio.to_thread(_prepare_database, path)
        opened: list[aiosqlite.Connection] = []
        try:
            opened.append(await _connect(str(path)))
            for _ in range(readers):
                opened.append(await _connect(read_only_uri, uri=True))
        except BaseException:
            for conn in opened:
                await conn.close()
            raise
        return cls(path, opened[0], opened[1:])

    async def close(self) -> None:
        """Close every connection; safe to call twice."""
        for reader in self._readers:
            await reader.close()
        with contextlib.suppress(ValueError):  # already closed
            await self._writer.execute("PRAGMA optimize")
        await self._writer.close()

    async def check(self) -> None:
        """Raise unless both the writer and a reader answer (readiness probe)."""
        # Touch a table: SELECT 1 alone succeeds without reading the file at all.
        await migrations.recorded(SQLiteTransaction(self._writer))
        await migrations.recorded(self)

    async def size_bytes(self) -> int:
        """The file and its write-ahead log, in bytes."""
        files = [self.path, *(self.path.with_name(self.path.name + s) for s in ("-wal", "-shm"))]
        return sum(f.stat().st_size for f in files if f.exists())

    async def erase_deleted(self) -> None:
        """Checkpoint the WAL into the file and truncate it: with secure_delete on (every
        connection), a deleted row's pages are zeroed in the file, and the WAL frames that
        still held it are gone (docs/security.md, what a clear erases)."""
        async with self._write_lock:
            # (busy, frames in the WAL, frames copied): busy when a reader still holds an
            # older snapshot; the next purge truncates it (new writes overwrite it meanwhile).
            await self._writer.execute_fetchall("PRAGMA wal_checkpoint(TRUNCATE)")

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one read-only statement on a reader connection and return its rows."""
        reader = self._readers[next(self._next_reader)]
        return list(await reader.execute_fetchall(sql, params))

    @asynccontextmanager
    async def write(self) -> AsyncIterator[SQLiteTransaction]:
        """One write transaction (BEGIN IMMEDIATE): committed on exit, rolled back on error."""
        async with self._write_lock:
            # aiosqlite queues calls in order, so even when this task is cancelled
            # mid-await, the ROLLBACK runs after the statement that was interrupted.
            try:
                await _when_unlocked(lambda: self._writer.execute("BEGIN IMMEDIATE"))
                yield SQLiteTransaction(self._writer)
                await self._writer.commit()
            except BaseException:
                await self._writer.rollback()
                raise

    @asynccontextmanager
    async def autocommit(self) -> AsyncIterator[SQLiteTransaction]:
        """The writer for statements that each commit on their own (single-row updates)."""
        async with self._write_lock:
            yield SQLiteTransaction(self._writer, retry_locked=True)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """A lock on `key` until the block ends (in this process: one process owns the file)."""
        async with self._held.setdefault(key, asyncio.Lock()):
            yield


async def fetch_in(
    conn: Connection, sql: str, ids: Sequence[Any], *, prefix: Sequence[Any] = ()
) -> list[Row]:
    """Rows of `sql`, whose `{marks}` stands for the placeholders of `ids` (after those of
    `prefix`), read in batches."""
    rows: list[Row] = []
    for start in range(0, len(ids), IN_BATCH):
        batch = list(ids[start : start + IN_BATCH])
        rows += await conn.fetch(sql.format(marks=marks(len(batch))), [*prefix, *batch])
    return rows


def in_values(conn: Connection, values: Sequence[Any]) -> tuple[str, Any]:
    """SQL after a column that tests membership in `values`, and its one parameter."""
    if conn.dialect == "postgres":
        return "= ANY(?)", list(values)
    return "IN (SELECT value FROM json_each(?))", json.dumps(list(values))


async def column(
    conn: Connection, kind: Callable[[Any], _T], sql: str, params: Sequence[Any] = ()
) -> list[_T]:
    """The first column of every row of `sql`, each made a `kind`."""
    return [kind(row[0]) for row in await conn.fetch(sql, params)]


async def first(
    conn: Connection, kind: Callable[[Any], _T], sql: str, params: Sequence[Any] = ()
) -> _T | None:
    """The first column of the first row of `sql` as a `kind`; None without a row or value."""
    rows = await conn.fetch(sql, params)
    return None if not rows or rows[0][0] is None else kind(rows[0][0])


async def scalar(
    conn: Connection, kind: Callable[[Any], _T], sql: str, params: Sequence[Any] = ()
) -> _T:
    """The one value of an aggregate `sql` (a count, an EXISTS), as a `kind`."""
    return kind((await conn.fetch(sql, params))[0][0])


def equal_to(**columns: Any) -> tuple[str, list[Any]]:
    """SQL that tests each column given a value (None: not tested) for equality, and its
    parameters; TRUE when none is tested."""
    tested = {name: value for name, value in columns.items() if value is not None}
    return " AND ".join(f"{name} = ?" for name in tested) or "TRUE", list(tested.values())


def marks(count: int) -> str:
    """`count` comma-separated placeholders."""
    return ", ".join("?" * count)


def only_row(rows: Iterable[Row], error: str) -> Row:
    """The first row, or LookupError(error) when there is none."""
    for row in rows:
        return row
    raise LookupError(error)


async def _when_unlocked(statement: Callable[[], Awaitable[_T]]) -> _T:
    """Run a statement that takes the write lock, again while another process (a backup, a
    sqlite3 shell) holds that lock past the busy timeout: a statement refused as "locked"
    changed nothing, so trying again is safe, and a turn is not lost to a long lock."""
    for _ in range(_LOCKED_ATTEMPTS - 1):
        try:
            return await statement()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                raise
    return await statement()


def _prepare_database(path: Path) -> str:
    """Migrate the file and return the URI that opens it read-only."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA secure_delete = ON")  # migrations delete too
        # WAL is a property of the file: set once here, every later connection uses it.
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        migrations.apply(conn)
    finally:
        conn.close()
    return f"{path.resolve().as_uri()}?mode=ro"


async def _connect(database: str, *, uri: bool = False) -> aiosqlite.Connection:
    # isolation_level=None: transactions are begun explicitly, never implicitly.
    conn = await aiosqlite.connect(database, uri=uri, isolation_level=None)
    try:
        for pragma in (
            f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}",
            "PRAGMA foreign_keys = ON",
            "PRAGMA synchronous = NORMAL",
            # Deleted content is overwritten with zeros, not left in free pages for anyone
            # who reads the file (docs/security.md, what a clear erases).
            "PRAGMA secure_delete = ON",
        ):
            await conn.execute(pragma)
    except BaseException:
        await conn.close()
        raise
    return conn
