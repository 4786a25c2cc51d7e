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
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from memory.storage import migrations, postgres_schema
from memory.storage.interface import Dialect, Row

PostgresError = asyncpg.PostgresError  # what a statement the server refuses raises
# Any fixed number: the advisory lock every write transaction holds until it ends.
_WRITE_LOCK = 7_305_210_412
# Any fixed int4: the namespace of hold()'s locks (two-key advisory locks, apart from the above).
_KEY_LOCKS = 730_521


class PostgresTransaction:
    """Statements on one pooled connection (inside a transaction for `write()`)."""

    dialect: Dialect = "postgres"

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement and return its rows (RETURNING rows, or none)."""
        return list(await self._conn.fetch(numbered(sql), *params))

    async def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one INSERT/UPDATE/DELETE and return how many rows it changed."""
        status: str = await self._conn.execute(numbered(sql), *params)
        return int(status.rsplit(" ", 1)[-1])  # "UPDATE 3", "INSERT 0 3"

    async def change_many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""
        await self._conn.executemany(numbered(sql), list(rows))


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
        size: int = await self._pool.fetchval("SELECT pg_database_size(current_database())")
        return size

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one read-only statement on a pooled connection and return its rows."""
        return list(await self._pool.fetch(numbered(sql), *params))

    @asynccontextmanager
    async def write(self) -> AsyncIterator[PostgresTransaction]:
        """One write transaction, serialized with every replica's: committed on exit,
        rolled back on error."""
        async with self._write_lock, self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _WRITE_LOCK)
            yield PostgresTransaction(conn)

    @asynccontextmanager
    async def autocommit(self) -> AsyncIterator[PostgresTransaction]:
        """A pooled connection whose statements each commit on their own."""
        async with self._pool.acquire() as conn:
            yield PostgresTransaction(conn)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """A lock on `key` against every replica until the block ends (or the replica dies:
        its connection closes and the server releases the lock)."""
        # A connection of its own, not a pooled one: the holder's work reads and writes
        # through the pool, so holders filling the pool would wait on each other for good.
        conn = await asyncpg.connect(self._url)
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", _KEY_LOCKS, key)
                yield
        finally:
            await conn.close()


@functools.lru_cache(maxsize=1024)
def numbered(sql: str) -> str:
    """`sql` with its `?` placeholders renumbered `$1..$n`; `?` in quotes or comments stays."""
    out: list[str] = []
    count = 0
    quote: str | None = None  # the character that ends the quote or comment we are in
    for at, char in enumerate(sql):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in ("'", '"'):
            quote = char
        elif sql.startswith("--", at):
            quote = "\n"
        elif char == "?":
            count += 1
            out.append(f"${count}")
            continue
        out.append(char)
    return "".join(out)
