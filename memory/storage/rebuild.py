"""Rebuilding an SQLite table for a schema change ALTER TABLE cannot make (a CHECK changed),
as SQLite's documentation says ("ALTER TABLE", Making Other Kinds Of Table Schema Changes).

The rows are copied with their rowids, so an FTS5 index kept by rowid (content='<table>')
stays right; the table's indexes and triggers are made again from their saved SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Executes(Protocol):
    """A plain sqlite3 connection, as migrations get one (sqlite3 stays in
    memory/storage/migrations.py)."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...


def rebuild_table(conn: Executes, table: str, change: Callable[[str], str]) -> None:
    """Make `table` again with the CREATE TABLE statement `change` returns for its current
    one, keeping every row of the columns both have. Runs inside the caller's transaction;
    no foreign key may point at `table`."""
    found = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                         (table,)).fetchone()
    if found is None:
        raise ValueError(f"no table {table!r} to rebuild")
    attached = conn.execute(
        "SELECT sql FROM sqlite_master WHERE tbl_name = ? AND type IN ('index', 'trigger')"
        " AND sql IS NOT NULL ORDER BY rowid", (table,),
    ).fetchall()
    columns = ", ".join(str(row[1]) for row in conn.execute(f"PRAGMA table_info({table})"))
    new = f"{table}_rebuilt"  # lives only inside the caller's transaction
    statement = change(str(found[0]))
    conn.execute(statement.replace(table, new, 1))
    conn.execute(f"INSERT INTO {new} ({columns}) SELECT {columns} FROM {table}")
    conn.execute(f"DROP TABLE {table}")
    conn.execute(f"ALTER TABLE {new} RENAME TO {table}")
    for (sql,) in attached:
        conn.execute(sql)


_REUSED_ID = "id INTEGER PRIMARY KEY,"


def autoincrement_ids(conn: Executes, tables: tuple[str, ...]) -> None:
    """Rebuild `tables` so their ids are never handed out again (migration 0016): a plain
    INTEGER PRIMARY KEY takes the largest id + 1, so deleting the newest fact gave its id to
    the next one, and a client holding the old id reached another fact. AUTOINCREMENT
    remembers the largest id ever used (sqlite_sequence), as PostgreSQL's sequences do.
    Facts and summaries are the integer ids that leave the server and can be deleted one by
    one (docs/memory-api.md); sessions and stored keys have text ids never reused."""

    def change(table: str) -> str:
        if _REUSED_ID not in table:
            raise ValueError("unexpected schema: its id is not a plain INTEGER PRIMARY KEY")
        return table.replace(_REUSED_ID, "id INTEGER PRIMARY KEY AUTOINCREMENT,", 1)

    for table in tables:
        rebuild_table(conn, table, change)
