"""Named, ordered schema migrations recorded in a `migrations` table.

Each migration is `(name, step)` where `step` is SQL text or a function taking a plain
`sqlite3.Connection`. `apply()` runs the missing ones in list order, each inside its own
transaction together with the row that records it, so a crash never leaves a migration
half-applied or applied-but-unrecorded. To change the schema, append a new entry such as
`("0002_facts", _FACTS_SQL)` to `MIGRATIONS`; never edit or reorder one that has shipped.

The tables PostgreSQL has too are declared once, in memory/storage/schema.py; what is
SQLite's own (FTS5's tables, the triggers, table rebuilds) is written here.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from memory.storage import schema
from memory.storage.rebuild import autoincrement_ids, rebuild_table
from memory.storage.schema import for_sqlite

if TYPE_CHECKING:
    from memory.storage.interface import Connection

MigrationStep = str | Callable[[sqlite3.Connection], None]
Migration = tuple[str, MigrationStep]

# FTS5 indexes a chunk's text and its owner/sess tokens (memory/storage/schema.py, CHUNKS).
# External content: the text lives once, in chunks. New chunks are indexed by
# Store.add_chunks with one INSERT ... SELECT per batch: an AFTER INSERT trigger would make
# FTS5 flush a segment per row (it syncs on every savepoint), indexing ~5x slower.
# Updates and deletes (rare, and deletes also arrive by cascade from turns) use triggers,
# which pass the old row's exact values as FTS5 requires. Never use INSERT OR REPLACE on
# chunks: REPLACE deletes rows without firing the delete trigger.
_CHUNKS_FTS = """
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
"""

_INITIAL = (
    for_sqlite(schema.SESSIONS + schema.TURNS + schema.CHUNKS)
    + _CHUNKS_FTS
    + for_sqlite(schema.JOBS_AND_METRICS)
)

# Facts are written one at a time, so plain triggers keep the index (unlike chunks).
_FACTS_FTS = """
CREATE VIRTUAL TABLE facts_fts USING fts5(
    text, owner, content='facts', content_rowid='id', tokenize='porter unicode61'
);
INSERT INTO facts_fts (facts_fts, rank) VALUES ('rank', 'bm25(1.0, 0.0)');
CREATE TRIGGER facts_fts_insert AFTER INSERT ON facts BEGIN
    INSERT INTO facts_fts (rowid, text, owner) VALUES (new.id, new.text, new.owner);
END;
CREATE TRIGGER facts_fts_delete AFTER DELETE ON facts BEGIN
    INSERT INTO facts_fts (facts_fts, rowid, text, owner) VALUES ('delete', old.id, old.text, old.owner);
END;
CREATE TRIGGER facts_fts_update AFTER UPDATE OF text, owner ON facts BEGIN
    INSERT INTO facts_fts (facts_fts, rowid, text, owner) VALUES ('delete', old.id, old.text, old.owner);
    INSERT INTO facts_fts (rowid, text, owner) VALUES (new.id, new.text, new.owner);
END;
"""

_SUMMARIES_FTS = """
CREATE VIRTUAL TABLE summaries_fts USING fts5(
    text, owner, sess, content='summaries', content_rowid='id', tokenize='porter unicode61'
);
INSERT INTO summaries_fts (summaries_fts, rank) VALUES ('rank', 'bm25(1.0, 0.0, 0.0)');
CREATE TRIGGER summaries_fts_insert AFTER INSERT ON summaries BEGIN
    INSERT INTO summaries_fts (rowid, text, owner, sess) VALUES (new.id, new.text, new.owner, new.sess);
END;
CREATE TRIGGER summaries_fts_delete AFTER DELETE ON summaries BEGIN
    INSERT INTO summaries_fts (summaries_fts, rowid, text, owner, sess)
    VALUES ('delete', old.id, old.text, old.owner, old.sess);
END;
"""

_FACTS = (
    for_sqlite(schema.FACTS) + _FACTS_FTS + for_sqlite(schema.SUMMARIES) + _SUMMARIES_FTS
    + for_sqlite(schema.PROFILES)
)

# Recall (memory/engine.py): a chunk's speaker is indexed with its text, so a name in a query
# matches what that person said instead of every turn that merely addresses them; and the
# turn after a recalled one is found by parent_id (conversation context).
_RECALL = """
DROP TRIGGER chunks_fts_delete;
DROP TRIGGER chunks_fts_update;
DROP TABLE chunks_fts;
ALTER TABLE chunks ADD COLUMN speaker TEXT NOT NULL DEFAULT '';
UPDATE chunks SET speaker = (SELECT COALESCE(t.name, t.role) FROM turns AS t WHERE t.id = chunks.turn_id);
CREATE VIRTUAL TABLE chunks_fts USING fts5(
    text, speaker, owner, sess,
    content='chunks', content_rowid='id',
    tokenize='porter unicode61'
);
-- The speaker counts half as much as a word of the text; scope tokens never count.
INSERT INTO chunks_fts (chunks_fts, rank) VALUES ('rank', 'bm25(1.0, 0.5, 0.0, 0.0)');
INSERT INTO chunks_fts (chunks_fts) VALUES ('rebuild');
CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN
    INSERT INTO chunks_fts (chunks_fts, rowid, text, speaker, owner, sess)
    VALUES ('delete', old.id, old.text, old.speaker, old.owner, old.sess);
END;
CREATE TRIGGER chunks_fts_update AFTER UPDATE ON chunks BEGIN
    INSERT INTO chunks_fts (chunks_fts, rowid, text, speaker, owner, sess)
    VALUES ('delete', old.id, old.text, old.speaker, old.owner, old.sess);
    INSERT INTO chunks_fts (rowid, text, speaker, owner, sess)
    VALUES (new.id, new.text, new.speaker, new.owner, new.sess);
END;
CREATE INDEX turns_by_parent ON turns (parent_id);
"""


def _version_triggers() -> str:
    """Triggers that count every write to a user's memory in `memory_versions`.

    The row with session '' counts them all; a session's own row counts the turns and chunks
    added to that session. A recall cached for a session stays valid while the difference
    of the two is unchanged: a retry still hits after its own turns were stored (they are in
    its prompt), while anything else (another session's turns, a fact, a delete) misses.
    Triggers see the writes of every process sharing the database, whichever code made them.
    """
    bump = (
        "INSERT INTO memory_versions (user_id, session_id, version) VALUES ({user}, {session}, 1) "
        "ON CONFLICT (user_id, session_id) DO UPDATE SET version = version + 1;"
    )
    statements = []
    for table in schema.VERSIONED:
        for op in ("INSERT", "UPDATE", "DELETE"):
            row = "old" if op == "DELETE" else "new"
            body = bump.format(user=f"{row}.user_id", session="''")
            if op == "INSERT" and table in ("turns", "chunks"):
                body += bump.format(user="new.user_id", session="new.session_id")
            statements.append(
                f"CREATE TRIGGER {table}_version_{op.lower()} AFTER {op} ON {table} BEGIN {body} END;"
            )
    return "\n".join(statements)


# An organisation's shared fact (memory/scopes.py: its owner id starts with char(31)) is in
# the blocks of its members: forgetting it drops every block that shows it.
_SHARED_FACT_BLOCKS = (
    " DELETE FROM injections WHERE substr(old.user_id, 1, 1) = char(31)"
    " AND items LIKE '%\"f' || old.id || '\"%';"
)


def _forgetting_triggers() -> str:
    return "\n".join(
        f"CREATE TRIGGER {name} {event}{f' WHEN {rows}' if rows else ''}"
        " BEGIN DELETE FROM injections WHERE user_id = old.user_id;"
        f"{_SHARED_FACT_BLOCKS if name.startswith('facts_') else ''} END;"
        for name, event, rows in schema.FORGETTING
    )


# Stable injection and the recall cache (memory/storage/schema.py, INJECTIONS).
_INJECTIONS = (
    for_sqlite(schema.INJECTIONS) + _version_triggers() + "\n" + _forgetting_triggers()
)

_OLD_SOURCES = "CHECK (source IN ('extracted', 'manual', 'import'))"


def _fact_provenance(conn: sqlite3.Connection) -> None:
    """Facts may come from MCP (source 'mcp') and name the client that added them."""
    def change(table: str) -> str:
        if _OLD_SOURCES not in table:
            raise ValueError("facts has an unexpected schema; not rebuilding it")
        table = table.replace(_OLD_SOURCES, _OLD_SOURCES.replace("'import'", "'import', 'mcp'"))
        return table[: table.rindex(")")] + ",\n    client TEXT NULL\n)"

    rebuild_table(conn, "facts", change)


MIGRATIONS: list[Migration] = [
    ("0001_initial", _INITIAL),
    ("0002_facts", _FACTS),
    ("0003_clears", for_sqlite(schema.CLEARS)),
    ("0004_recall", _RECALL),
    # A Responses API request names the reply it continues (previous_response_id): the
    # reply turn's request_id holds that response id, found per user by this index.
    ("0005_reply_lookup", schema.REPLY_LOOKUP),
    ("0006_injections", _INJECTIONS),
    # Per-user vector generations (memory/storage/versions.py): bumped after every write of
    # a user's vectors, so replicas sharing a Chroma server know their copies are stale;
    # rows per session as in memory_versions, for the recall cache.
    ("0007_vector_generations", for_sqlite(schema.VECTOR_GENERATIONS)),
    # Recall takes the names a user's turns were said under out of its query
    # (memory/recall/speakers.py): this index finds them one name at a time, not by reading
    # every turn of the user (65 ms at 100k turns).
    ("0008_turn_speakers", schema.TURN_SPEAKERS),
    # PostgreSQL's chunk postings (memory.storage.postgres_schema); FTS5 keeps its own, so
    # nothing changes here: the name is recorded so both backends list the same migrations.
    ("0009_chunk_postings", lambda conn: None),
    # Whose reply a response id is, whoever asks (proxy/access/ownership.py): the first user a
    # reply turn was stored for under that id.
    ("0010_reply_owner", schema.REPLY_OWNER),
    # Fair claims between users (memory/storage/jobs.py): a job's owner and its place in
    # the fair order; jobs queued before keep the order they had (fair_at = run_after).
    ("0011_fair_jobs", for_sqlite(schema.FAIR_JOBS)),
    # Provenance (docs/mcp.md): a fact added over MCP has source 'mcp' and the name the
    # client gave itself.
    ("0012_fact_provenance", _fact_provenance),
    # Keys in the database (docs/keys.md), stored hashed.
    ("0013_api_keys", for_sqlite(schema.API_KEYS)),
    # Usage and quotas (docs/usage.md): usage per day, then quota holds and rate buckets.
    ("0014_usage", for_sqlite(schema.USAGE)),
    ("0015_quota_holds", for_sqlite(schema.QUOTA_HOLDS)),
    ("0016_lasting_ids", lambda conn: autoincrement_ids(conn, ("facts", "summaries"))),
]


def apply(conn: sqlite3.Connection, migrations: Sequence[Migration] = MIGRATIONS) -> list[str]:
    """Apply the migrations not yet recorded, in order, and return their names."""
    names = [name for name, _ in migrations]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate migration names in {names}")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)"
    )
    return [name for name, step in migrations if _apply_one(conn, name, step)]


def applied(conn: sqlite3.Connection) -> list[str]:
    """Names of the migrations recorded in the database, in the order they ran."""
    rows = conn.execute("SELECT name FROM migrations ORDER BY rowid").fetchall()
    return [str(row[0]) for row in rows]


async def recorded(conn: Connection) -> int:
    """How many migrations the database records (a read that touches the file)."""
    rows = await conn.fetch("SELECT COUNT(*) FROM migrations")
    return int(rows[0][0])


def _apply_one(conn: sqlite3.Connection, name: str, step: MigrationStep) -> bool:
    with conn:  # commits at the end; rolls back on any exception, or when the commit fails
        # IMMEDIATE takes the write lock before the check, so two processes starting at
        # once cannot both decide to run the same migration.
        conn.execute("BEGIN IMMEDIATE")
        done = conn.execute("SELECT 1 FROM migrations WHERE name = ?", (name,)).fetchone()
        if done is None:
            _run_step(conn, step)
            conn.execute(
                "INSERT INTO migrations (name, applied_at) VALUES (?, ?)", (name, time.time())
            )
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
