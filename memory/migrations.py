"""Named, ordered schema migrations recorded in a `migrations` table.

Each migration is `(name, step)` where `step` is SQL text or a function taking a plain
`sqlite3.Connection`. `apply()` runs the missing ones in list order, each inside its own
transaction together with the row that records it, so a crash never leaves a migration
half-applied or applied-but-unrecorded. To change the schema, append a new entry such as
`("0002_facts", _FACTS_SQL)` to `MIGRATIONS`; never edit or reorder one that has shipped.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence

MigrationStep = str | Callable[[sqlite3.Connection], None]
Migration = tuple[str, MigrationStep]

_INITIAL = """
CREATE TABLE sessions (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_active REAL NOT NULL,
    turn_count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (user_id, session_id)
);

CREATE TABLE turns (
    id INTEGER PRIMARY KEY,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    parent_id INTEGER NULL REFERENCES turns(id),
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    name TEXT NULL,
    content TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    model TEXT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    request_id TEXT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0
);
-- Exactly-once logging: one row per (conversation branch point, content).
-- COALESCE because NULLs are distinct in UNIQUE indexes.
CREATE UNIQUE INDEX turns_path ON turns (user_id, session_id, COALESCE(parent_id, 0), content_hash);
CREATE INDEX turns_by_hash ON turns (user_id, session_id, content_hash);

-- owner/sess hold one FTS token each so user and session scoping happen inside MATCH.
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY,
    turn_id INTEGER NOT NULL REFERENCES turns(id) ON DELETE CASCADE,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    ordinal INTEGER NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('code', 'prose')),
    text TEXT NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL,
    sess TEXT NOT NULL,
    UNIQUE (turn_id, ordinal)
);

-- External content: the text lives once, in chunks. New chunks are indexed by
-- Store.add_chunks with one INSERT ... SELECT per batch: an AFTER INSERT trigger would make
-- FTS5 flush a segment per row (it syncs on every savepoint), indexing ~5x slower.
-- Updates and deletes (rare, and deletes also arrive by cascade from turns) use triggers,
-- which pass the old row's exact values as FTS5 requires. Never use INSERT OR REPLACE on
-- chunks: REPLACE deletes rows without firing the delete trigger.
CREATE VIRTUAL TABLE chunks_fts USING fts5(
    text, owner, sess,
    content='chunks', content_rowid='id',
    tokenize='porter unicode61'
);
-- Scope tokens only filter; they must never add to the score.
INSERT INTO chunks_fts (chunks_fts, rank) VALUES ('rank', 'bm25(1.0, 0.0, 0.0)');

CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN
    INSERT INTO chunks_fts (chunks_fts, rowid, text, owner, sess)
    VALUES ('delete', old.id, old.text, old.owner, old.sess);
END;
CREATE TRIGGER chunks_fts_update AFTER UPDATE ON chunks BEGIN
    INSERT INTO chunks_fts (chunks_fts, rowid, text, owner, sess)
    VALUES ('delete', old.id, old.text, old.owner, old.sess);
    INSERT INTO chunks_fts (rowid, text, owner, sess)
    VALUES (new.id, new.text, new.owner, new.sess);
END;

CREATE TABLE jobs (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'done', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    run_after REAL NOT NULL,
    last_error TEXT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX jobs_ready ON jobs (status, run_after, id);

CREATE TABLE request_metrics (
    id INTEGER PRIMARY KEY,
    created_at REAL NOT NULL,
    user_id TEXT NOT NULL,
    session_id TEXT NULL,
    request_id TEXT NULL,
    model TEXT NULL,
    items_json TEXT NOT NULL,
    injected_tokens INTEGER NOT NULL DEFAULT 0,
    truncated INTEGER NOT NULL DEFAULT 0,
    recall_ms REAL NULL,
    embed_ms REAL NULL,
    error TEXT NULL
);
CREATE INDEX request_metrics_created ON request_metrics (created_at);
"""

MIGRATIONS: list[Migration] = [
    ("0001_initial", _INITIAL),
]


def apply(conn: sqlite3.Connection, migrations: Sequence[Migration] = MIGRATIONS) -> list[str]:
    """Apply the migrations not yet recorded, in order, and return their names."""
    _check_names(migrations)
    conn.execute(
        "CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)"
    )
    newly_applied = []
    for name, step in migrations:
        if _apply_one(conn, name, step):
            newly_applied.append(name)
    return newly_applied


def applied(conn: sqlite3.Connection) -> list[str]:
    """Names of the migrations recorded in the database, in the order they ran."""
    rows = conn.execute("SELECT name FROM migrations ORDER BY rowid").fetchall()
    return [str(row[0]) for row in rows]


def _apply_one(conn: sqlite3.Connection, name: str, step: MigrationStep) -> bool:
    # IMMEDIATE takes the write lock before the check, so two processes starting at
    # once cannot both decide to run the same migration.
    conn.execute("BEGIN IMMEDIATE")
    try:
        done = conn.execute("SELECT 1 FROM migrations WHERE name = ?", (name,)).fetchone()
        if done is None:
            _run_step(conn, step)
            conn.execute(
                "INSERT INTO migrations (name, applied_at) VALUES (?, ?)", (name, time.time())
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return done is None


def _run_step(conn: sqlite3.Connection, step: MigrationStep) -> None:
    if callable(step):
        step(conn)
        return
    # Not executescript(): it commits first, which would break the one-transaction rule.
    for statement in split_statements(step):
        conn.execute(statement)


def split_statements(script: str) -> Iterator[str]:
    """Split an SQL script into complete statements (trigger bodies stay whole)."""
    pending = ""
    *pieces, tail = script.split(";")
    for piece in pieces:
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if _strip_comments(pending).strip(" \n\t;"):
                yield pending
            pending = ""
    pending += tail
    if _strip_comments(pending).strip(" \n\t;"):
        raise ValueError(f"incomplete SQL statement in migration: {pending.strip()!r}")


def _strip_comments(sql: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in sql.splitlines())


def _check_names(migrations: Sequence[Migration]) -> None:
    names = [name for name, _ in migrations]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate migration names in {names}")
