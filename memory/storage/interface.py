"""The database interface the table modules write against (`memory.storage.database` has
the SQLite implementation, `memory.storage.postgres` the PostgreSQL one): kept apart so both
implementations and the migrations read it without importing each other."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, Protocol

Dialect = Literal["sqlite", "postgres"]


class Row(Protocol):
    """A result row, by position (or slice) or column name: sqlite3.Row or asyncpg's Record."""

    def __getitem__(self, key: Any, /) -> Any: ...

    def __iter__(self) -> Any: ...

    def __len__(self) -> int: ...


class Connection(Protocol):
    """What the table functions read through: a Database (a reader) or a Transaction."""

    @property
    def dialect(self) -> Dialect:
        """Which SQL the connection speaks."""
        ...

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one statement and return its rows."""
        ...


class Transaction(Connection, Protocol):
    """Statements of one write."""

    async def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one INSERT/UPDATE/DELETE and return how many rows it changed."""
        ...

    async def change_many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""
        ...


class Database(Connection, Protocol):
    """The memory database: reads, write transactions, readiness, closing."""

    def write(self) -> AbstractAsyncContextManager[Transaction]:
        """One write transaction: committed on exit, rolled back on error."""
        ...

    def autocommit(self) -> AbstractAsyncContextManager[Transaction]:
        """A connection whose statements each commit on their own (single-row updates)."""
        ...

    def hold(self, key: str) -> AbstractAsyncContextManager[None]:
        """A lock on `key`, held until the block ends, against every process sharing the
        database, for work that spans several writes (and vector writes) of one user."""
        ...

    async def check(self) -> None:
        """Raise unless the database answers (readiness probe)."""
        ...

    async def size_bytes(self) -> int:
        """How much storage the database takes."""
        ...

    async def erase_deleted(self) -> None:
        """After a purge: leave no copy of deleted rows in the database's own files where
        the backend can do that cheaply (docs/security.md, what a clear erases)."""
        ...

    async def close(self) -> None:
        """Close every connection; safe to call twice."""
        ...
