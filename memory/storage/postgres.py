"""The PostgreSQL database (MEMPROXY_DATABASE_URL): the `Database` interface on an asyncpg
pool, for any number of replicas sharing one server; the only asyncpg user.

The table modules' SQL is written with SQLite's `?` placeholders; each statement is
renumbered to `$1..$n` once (cached) and then prepared by asyncpg, which caches the plan per
connection. Reads run on any pooled connection. A write transaction first takes one
transaction-level advisory lock, so writes are serialized across every replica exactly as
SQLite's BEGIN IMMEDIATE serializes them in one file: what a write reads (the turns already
logged, a fact to merge with) cannot change before it commits. Statements in `autocommit()`
(the job queue's claims and settlements, metrics rows) each commit on their own without it;
claims skip locked rows instead (memory.storage.jobs). `hold(key)` is a transaction-level
advisory lock on the key's hash, for work of one user that spans several writes.

A server restart leaves the pool holding connections that are dead. A connection error is
retried once, on a fresh connection, only where that is safe: a read; the start of a write
transaction (its lock statement runs before any of the caller's statements); a statement of
`autocommit()` (each is one statement that may run twice: claims come back when their lease
ends, settlements match their claim, a metrics row is a count). The pool's other idle
connections are dropped at the same time, so no later request meets one. What still fails
leaves this module as `memory.outages.Unavailable`: the caller waits the outage out or
spools (memory.log.spooling).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg
from asyncpg import exceptions as pg_errors

from memory.outages import CannotOpen, Unavailable
from memory.storage import migrations, postgres_schema
from memory.storage.interface import Dialect, Row

PostgresError = asyncpg.PostgresError  # what a statement the server refuses raises
# Any fixed number: the advisory lock every write transaction holds until it ends.
_WRITE_LOCK = 7_305_210_412
# Any fixed int4: the namespace of hold()'s locks (two-key advisory locks, apart from the above).
_KEY_LOCKS = 730_521
_T = TypeVar("_T")
# A quote or comment (to its end, or the text's when it has none), or a placeholder.
_QUOTED_OR_MARK = re.compile(r"'[^']*'?|\"[^\"]*\"?|--[^\n]*\n?|\?")
# Long enough for a few turns of the event loop: they read what the server said on the
# connections it closed. Spent only after a connection was found lost.
_SETTLE_SECONDS = 0.02
# The server is gone, restarting, shutting down or full, or dropped this connection: not the
# statement's fault. (Not every OperatorInterventionError: 57014 is a cancelled statement.)
_CONNECTION_ERRORS = (
    OSError, asyncpg.PostgresConnectionError, pg_errors.AdminShutdownError,
    pg_errors.CrashShutdownError, pg_errors.CannotConnectNowError,
    pg_errors.TooManyConnectionsError,
)


CONNECT_SECONDS = 10.0


async def check_reachable(url: str, shown: str, *, named: str) -> None:
    """Connect to `url` once and leave; CannotOpen when the server does not take the
    connection. `shown`: the address without its password; `named`: what set it (the
    setting or argument a user changes)."""
    part = f"the database (PostgreSQL at {shown})"
    try:
        conn = await asyncpg.connect(url, timeout=CONNECT_SECONDS)
    except pg_errors.InvalidCatalogNameError as exc:
        raise CannotOpen(part, str(exc), f"create it (createdb) or fix {named}") from None
    except (pg_errors.InvalidPasswordError,
            pg_errors.InvalidAuthorizationSpecificationError) as exc:
        raise CannotOpen(part, str(exc), f"fix the user or password in {named}") from None
    except (OSError, TimeoutError, pg_errors.PostgresError, pg_errors.InterfaceError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CannotOpen(part, f"no connection ({reason})",
                         f"start the server, or fix the host and port in {named}") from None
    await conn.close()


def connection_lost(exc: BaseException) -> bool:
    """Whether `exc` says the connection to the server failed, not the statement."""
    if isinstance(exc, asyncpg.InterfaceError):
        # A pooled connection the server closed; not "pool is closing" (our own shutdown).
        return "connection is closed" in str(exc) or "connection was closed" in str(exc)
    return isinstance(exc, _CONNECTION_ERRORS)


async def _drop_stale(pool: asyncpg.Pool) -> None:
    """After a lost connection: let the event loop read the other connections' news (the
    server's goodbye, the socket's end), so the pool sees them closed and opens new ones,
    and retire the rest of this generation as they come back."""
    await pool.expire_connections()
    await asyncio.sleep(_SETTLE_SECONDS)


def _closed(conn: asyncpg.Connection) -> bool:
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:  # already handed back to the pool
        return True


async def _roll_back(conn: asyncpg.Connection, transaction: Any) -> None:
    if not _closed(conn):
        with contextlib.suppress(Exception):  # the release resets it anyway
            await transaction.rollback()


@asynccontextmanager
async def _unavailable_when_lost() -> AsyncIterator[None]:
    try:
        yield
    except Exception as exc:
        if connection_lost(exc):
            raise Unavailable("PostgreSQL", f"{type(exc).__name__}: {exc}") from exc
        raise


class PostgresTransaction:
    """Statements on one pooled connection (inside a transaction for `write()`)."""

    dialect: Dialect = "postgres"

    def __init__(self, conn: asyncpg.Connection, *, pool: asyncpg.Pool | None = None) -> None:
        self._conn = conn
        # Given for autocommit(): a statement whose connection was lost runs again on another.
        self._pool = pool

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement and return its rows (RETURNING rows, or none)."""
        return list(await self._run(lambda conn: conn.fetch(numbered(sql), *params)))

    async def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one INSERT/UPDATE/DELETE and return how many rows it changed."""
        status: str = await self._run(lambda conn: conn.execute(numbered(sql), *params))
        return int(status.rsplit(" ", 1)[-1])  # "UPDATE 3", "INSERT 0 3"

    async def change_many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""
        listed = list(rows)
        await self._run(lambda conn: conn.executemany(numbered(sql), listed))

    async def _run(self, statement: Callable[[asyncpg.Connection], Awaitable[_T]]) -> _T:
        try:
            return await statement(self._conn)
        except Exception as exc:
            if self._pool is None or not connection_lost(exc):
                raise
        pool = self._pool
        await pool.release(self._conn)
        await _drop_stale(pool)
        self._conn = await pool.acquire()
        return await statement(self._conn)

    async def release(self) -> None:
        """Give the connection back to the pool (autocommit())."""
        if self._pool is not None:
            await self._pool.release(self._conn)


class PostgresDatabase:
    """The memory database on a PostgreSQL server, shared by every replica."""

    dialect: Dialect = "postgres"

    def __init__(self, pool: asyncpg.Pool, url: str) -> None:
        self._pool = pool
        self._url = url
        # Writers of this process queue here rather than each holding a pooled connection
        # while it waits for the database lock, which would leave none for reads.
        self._write_lock = asyncio.Lock()

    @classmethod
    async def open(cls, url: str, *, connections: int = 10) -> PostgresDatabase:
        """Connect to `url`, create or upgrade the schema, and keep a pool of connections."""
        conn = await asyncpg.connect(url)
        try:
            await postgres_schema.apply(conn)
        finally:
            await conn.close()
        pool = await asyncpg.create_pool(url, min_size=1, max_size=connections)
        return cls(pool, url)

    async def close(self) -> None:
        """Close every connection; safe to call twice."""
        await self._pool.close()

    async def check(self) -> None:
        """Raise unless the server answers a read of the schema (readiness probe)."""
        await migrations.recorded(self)

    async def size_bytes(self) -> int:
        """The database's size on the server, in bytes."""
        rows = await self.fetch("SELECT pg_database_size(current_database())")
        return int(rows[0][0])

    async def erase_deleted(self) -> None:
        """Nothing: PostgreSQL keeps a deleted row's bytes in its pages until VACUUM lets
        them be reused and new rows overwrite them, and in WAL until the segment is recycled.
        memproxy does not VACUUM after a purge: autovacuum does it for every replica, and
        only VACUUM FULL (an exclusive lock on each table) would rewrite the files
        (docs/security.md, what a clear erases)."""

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one read-only statement on a pooled connection and return its rows."""
        async with self.autocommit() as conn:  # a read runs again on a fresh connection
            return await conn.fetch(sql, params)

    @asynccontextmanager
    async def write(self) -> AsyncIterator[PostgresTransaction]:
        """One write transaction, serialized with every replica's: committed on exit,
        rolled back on error."""
        async with self._write_lock, _unavailable_when_lost():
            conn, transaction = await self._begin()
            try:
                yield PostgresTransaction(conn)
            except BaseException:
                await _roll_back(conn, transaction)
                raise
            else:
                await transaction.commit()
            finally:
                await self._pool.release(conn)

    async def _begin(self, *, again: bool = True) -> tuple[asyncpg.Connection, Any]:
        """A pooled connection in a write transaction holding the write lock; a connection
        found dead on the way is replaced once (none of the caller's statements ran yet)."""
        conn = await self._pool.acquire()
        transaction = conn.transaction()
        try:
            await transaction.start()
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _WRITE_LOCK)
            return conn, transaction
        except BaseException as exc:
            await _roll_back(conn, transaction)
            await self._pool.release(conn)
            if not again or not connection_lost(exc):
                raise
        await _drop_stale(self._pool)
        return await self._begin(again=False)

    @asynccontextmanager
    async def autocommit(self) -> AsyncIterator[PostgresTransaction]:
        """A pooled connection whose statements each commit on their own."""
        async with _unavailable_when_lost():
            tx = PostgresTransaction(await self._pool.acquire(), pool=self._pool)
            try:
                yield tx
            finally:
                await tx.release()

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """A lock on `key` against every replica until the block ends (or the replica dies:
        its connection closes and the server releases the lock)."""
        # A connection of its own, not a pooled one: the holder's work reads and writes
        # through the pool, so holders filling the pool would wait on each other for good.
        async with _unavailable_when_lost():
            conn = await asyncpg.connect(self._url)
        try:
            async with _unavailable_when_lost(), conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", _KEY_LOCKS, key)
                yield
        finally:
            if not _closed(conn):
                await conn.close()


@functools.lru_cache(maxsize=1024)
def numbered(sql: str) -> str:
    """`sql` with its `?` placeholders renumbered `$1..$n`; `?` in quotes or comments stays."""
    count = itertools.count(1)
    return _QUOTED_OR_MARK.sub(lambda m: f"${next(count)}" if m[0] == "?" else m[0], sql)
