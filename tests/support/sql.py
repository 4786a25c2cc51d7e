"""Reading memproxy's database from a test as an operator would, past the server: the SQLite
file, or the PostgreSQL database of `database_url`. Synchronous, so it serves plain tests and
async ones alike (PostgreSQL is read on a thread with its own event loop)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

import asyncpg

from config import Settings
from memory.storage.postgres import numbered

# What holds the database: a memproxy's settings, or a SQLite file.
Target = Settings | Path


def query(target: Target, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """The rows of one statement (SQLite's `?` placeholders on both backends); a write
    commits."""
    if isinstance(target, Settings) and target.database_url:
        url = target.database_url
        with ThreadPoolExecutor(1) as thread:
            return thread.submit(asyncio.run, _postgres(url, sql, params)).result()
    path = target.db_path if isinstance(target, Settings) else target
    with closing(sqlite3.connect(path, timeout=30)) as conn, conn:  # commits a write
        return [tuple(row) for row in conn.execute(sql, params)]


def scalar(target: Target, sql: str, params: Sequence[Any] = ()) -> Any:
    """The one value of a one-row, one-column statement."""
    ((value,),) = query(target, sql, params)
    return value


async def _postgres(url: str, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(row) for row in await conn.fetch(numbered(sql), *params)]
    finally:
        await conn.close()


# The chunks' postings on PostgreSQL (chunk_terms), as the rows' words say they should be.
POSTINGS_FROM_ROWS = """
SELECT c.user_id, t.lexeme, c.id, c.session_id,
    (cardinality(t.weights) - 0.5 * cardinality(array_remove(t.weights, 'A')))::REAL, c.doc_len
FROM chunks AS c CROSS JOIN LATERAL unnest(c.tsv) AS t"""
