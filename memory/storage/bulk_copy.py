"""Copying every table of an embedded SQLite database into PostgreSQL (`memproxy migrate`).

This is the one module that writes into every table, and it knows no table's meaning: what
it copies comes from the two schemas (the columns both have; PostgreSQL's own columns, such
as the full-text `tsv`, `doc_len` and `tf`, are left to its triggers, which also keep
`fts_totals`, `fts_terms` and the chunks' postings `chunk_terms`). It knows only the order,
parents before children, so every foreign key holds as rows arrive. Kept apart from the
table modules because a copy is row-for-row and schema-driven: a function per table would
repeat the same statement.

Resuming: rows go in batches in rowid order (ids are kept), and each batch commits together
with its table's progress row in `memproxy_migrate`, so an interrupted copy goes on after the
last committed batch. ON CONFLICT DO NOTHING skips a row the destination has already: the
rows of `memory_versions` are mostly made by the destination's triggers before their copies
come (and keep the destination's counts). AFTER INSERT triggers, such as the full-text
counters, fire only for rows really inserted. `memproxy_migrate` is this module's
bookkeeping, kept afterwards as the record of the copy; it also tells a database a copy began
in from one that already holds other memory, which is refused.

The source is read in one transaction of a connection in SQLite's exclusive locking mode:
one consistent snapshot, and a refusal while any other process (a running memproxy) has the
file open.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory.storage import migrations
from memory.storage.database import Transaction
from memory.storage.postgres import PostgresDatabase

Source = sqlite3.Connection  # the snapshot() being copied
# Parents before children: turns before chunks and injections, clears before clear_records.
TABLES = (
    "sessions", "turns", "chunks", "jobs", "request_metrics", "facts", "summaries",
    "profiles", "consent", "clears", "clear_records", "injections", "memory_versions",
    "vector_generations", "api_keys", "usage_daily",
)
# Not copied: the schema's own record (the destination has its own), FTS5's tables, whose
# work PostgreSQL's triggers do, and the quota reservations and rate buckets of the running
# proxy (memory/storage/schema.py, QUOTA_HOLDS): state of requests in flight, not memory.
_NOT_COPIED = ("migrations", "usage_reservations", "rate_buckets")
_FTS5 = ("chunks_fts", "facts_fts", "summaries_fts")
_PROGRESS = """
CREATE TABLE IF NOT EXISTS memproxy_migrate (
    source TEXT NOT NULL,
    name TEXT NOT NULL,
    last_rowid BIGINT NOT NULL,
    copied BIGINT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (source, name)
)
"""
_CONVERT: dict[str, Callable[[Any], Any]] = {
    "bigint": int, "integer": int, "double precision": float, "text": str,
}


class SourceBusy(Exception):
    """Another process has the source database open (a memproxy still running)."""


class CopyRefused(Exception):
    """The copy cannot be made as asked (a destination that holds other memory, a schema
    this version does not know); nothing was written."""


@dataclass(frozen=True)
class Batch:
    """One committed batch, as told to the progress callback."""

    table: str
    rows: int  # read from the source
    inserted: int  # new in the destination (fewer when a batch is copied again)


@contextmanager
def snapshot(path: Path) -> Iterator[Source]:
    """The source database, upgraded to this version's schema, read in one transaction that
    no other process can share; SourceBusy when one has the file open."""
    if not path.is_file():
        raise CopyRefused(f"no memproxy database at {path}")
    with closing(sqlite3.connect(path, timeout=1, isolation_level=None)) as conn:
        try:
            # Exclusive locking mode takes the file for this connection alone, so a server
            # that has it open (even idle) makes this fail, and none can open it meanwhile.
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            conn.execute("BEGIN EXCLUSIVE")
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            raise SourceBusy(
                f"{path} is in use by another process ({exc}): stop memproxy before migrating"
            ) from exc
        migrations.apply(conn)  # what the next start would do; refused above while one runs
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield conn
        finally:
            conn.execute("ROLLBACK")


async def begin(
    source: Source, dest: PostgresDatabase, *, source_name: str
) -> dict[str, int]:
    """Where an earlier copy from this source stopped: the last rowid copied per table, and
    what else record() noted ({} for a new copy). CopyRefused when the copy cannot be made
    (see _progress)."""
    _check_tables(source)
    async with dest.write() as tx:
        await tx.fetch(_PROGRESS)
        return await _progress(tx, source_name)


async def copy_tables(
    source: Source, dest: PostgresDatabase, *, source_name: str,
    done: dict[str, int], batch_size: int = 2000,
    on_batch: Callable[[Batch], None] | None = None,
) -> dict[str, int]:
    """Copy every table's rows after `done` (from begin()) into `dest`, in batches; return
    how many rows each table gained. `on_batch` is told after each commit (an error it
    raises stops the copy there, as an interruption would)."""
    gained = {
        table: await _copy_table(
            source, dest, table, source_name=source_name, after=done.get(table, 0),
            batch_size=batch_size, on_batch=on_batch,
        ) for table in TABLES
    }
    await _reset_sequences(dest)
    return gained


async def record(
    tx: Transaction, *, source_name: str, name: str, last: int, copied: int
) -> None:
    """Note that what `name` (a table, or another part of the copy) holds up to `last` has
    been copied, `copied` of it new; begin() returns it to the next run."""
    await tx.change(
        "INSERT INTO memproxy_migrate (source, name, last_rowid, copied, updated_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (source, name) DO UPDATE SET"
        " last_rowid = EXCLUDED.last_rowid,"
        " copied = memproxy_migrate.copied + EXCLUDED.copied,"
        " updated_at = EXCLUDED.updated_at",
        (source_name, name, last, copied, time.time()),
    )


async def count_rows(db: PostgresDatabase) -> dict[str, int]:
    """How many rows each copied table holds in `db`."""
    return {table: int((await db.fetch(f"SELECT COUNT(*) FROM {table}"))[0][0])
            for table in TABLES}


def source_counts(source: Source) -> dict[str, int]:
    """How many rows each copied table holds in the source snapshot."""
    return {table: int(source.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
            for table in TABLES}


def _check_tables(source: Source) -> None:
    names = {str(row[0]) for row in source.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite%'"
    )}
    unknown = sorted(n for n in names - {*TABLES, *_NOT_COPIED}
                     if not n.startswith(_FTS5))
    if unknown:
        raise CopyRefused(f"this memproxy cannot copy the table(s) {', '.join(unknown)}")


async def _progress(tx: Transaction, source_name: str) -> dict[str, int]:
    """The last copied rowid per table of this source; CopyRefused when the destination
    already holds memory that no copy from this source wrote."""
    rows = await tx.fetch("SELECT source, name, last_rowid FROM memproxy_migrate")
    others = sorted({str(row[0]) for row in rows} - {source_name})
    if others:
        raise CopyRefused(f"the destination holds a copy of {others[0]}, not {source_name};"
                          " migrate into a new, empty database")
    if not rows:
        for table in TABLES:
            if await tx.fetch(f"SELECT 1 FROM {table} LIMIT 1"):
                raise CopyRefused(f"the destination already holds memory ({table} has rows);"
                                  " migrate into a new, empty database")
    return {str(row[1]): int(row[2]) for row in rows}


async def _copy_table(
    source: Source, dest: PostgresDatabase, table: str, *, source_name: str,
    after: int, batch_size: int, on_batch: Callable[[Batch], None] | None,
) -> int:
    columns, insert = await _insert_statement(source, dest, table)
    convert = [_CONVERT[kind] for _, kind in columns]
    select = (f"SELECT rowid, {', '.join(name for name, _ in columns)} FROM {table}"
              " WHERE rowid > ? ORDER BY rowid LIMIT ?")
    last, gained = after, 0
    while rows := source.execute(select, (last, batch_size)).fetchall():
        arrays = [[None if row[i + 1] is None else fn(row[i + 1]) for row in rows]
                  for i, fn in enumerate(convert)]
        last = int(rows[-1][0])
        async with dest.write() as tx:
            inserted = await tx.change(insert, arrays)
            await record(tx, source_name=source_name, name=table, last=last, copied=inserted)
        gained += inserted
        if on_batch is not None:
            on_batch(Batch(table, len(rows), inserted))
    return gained


async def _insert_statement(
    source: Source, dest: PostgresDatabase, table: str
) -> tuple[list[tuple[str, str]], str]:
    """The columns both schemas have, with their PostgreSQL types, and the statement that
    inserts a batch of them (one array per column)."""
    ours = [str(row[1]) for row in source.execute(f"PRAGMA table_info({table})")]
    theirs = {str(row[0]): str(row[1]) for row in await dest.fetch(
        "SELECT column_name, data_type FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = ?", (table,)
    )}
    missing = [name for name in ours if name not in theirs]
    if missing:
        raise CopyRefused(f"the destination's {table} has no column {missing[0]}")
    columns = [(name, theirs[name]) for name in ours]
    arrays = ", ".join(f"?::{kind}[]" for _, kind in columns)
    names = ", ".join(name for name, _ in columns)
    return columns, (f"INSERT INTO {table} ({names}) SELECT * FROM unnest({arrays})"
                     " ON CONFLICT DO NOTHING")


async def _reset_sequences(dest: PostgresDatabase) -> None:
    """Start each copied table's id sequence after its largest id, so new rows do not
    collide with copied ones."""
    serial = await dest.fetch(
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND column_default LIKE 'nextval(%'"
    )
    async with dest.write() as tx:
        for table, column in ((str(r[0]), str(r[1])) for r in serial if str(r[0]) in TABLES):
            await tx.fetch(
                f"SELECT setval(pg_get_serial_sequence(?, ?), COALESCE(MAX({column}), 0) + 1,"
                f" false) FROM {table}", (table, column),
            )
