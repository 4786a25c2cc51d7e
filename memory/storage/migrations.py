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
from typing import TYPE_CHECKING

from memory.storage import usage_schema
from memory.storage.api_keys import SQLITE_TABLE as _API_KEYS
from memory.storage.rebuild import autoincrement_ids, rebuild_table

if TYPE_CHECKING:
    from memory.storage.interface import Connection

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

# Learned memory (docs/memory.md, Learning). A fact's versions share `chain_id` (the id of its
# first version): an edit or a contradiction inserts a new row and closes the old one with
# `valid_to` + `superseded_by`, so history is kept and a delete removes the whole chain.
# previous_id / superseded_by are not foreign keys: a chain is deleted in one statement.
_FACTS = """
CREATE TABLE facts (
    id INTEGER PRIMARY KEY,
    chain_id INTEGER NOT NULL,
    user_id TEXT NOT NULL,
    text TEXT NOT NULL,
    category TEXT NOT NULL CHECK (category IN ('identity', 'preference', 'project',
        'relationship', 'context', 'todo', 'decision')),
    confidence REAL NOT NULL,
    importance INTEGER NOT NULL,
    mentions INTEGER NOT NULL DEFAULT 1,
    source TEXT NOT NULL CHECK (source IN ('extracted', 'manual', 'import')),
    source_session TEXT NULL,
    source_turn_ids TEXT NOT NULL DEFAULT '[]',
    pinned INTEGER NOT NULL DEFAULT 0,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    expires_at REAL NULL,
    version INTEGER NOT NULL DEFAULT 1,
    previous_id INTEGER NULL,
    valid_from REAL NOT NULL,
    valid_to REAL NULL,
    superseded_by INTEGER NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    owner TEXT NOT NULL
);
CREATE INDEX facts_by_user ON facts (user_id, valid_to, id);
CREATE INDEX facts_by_chain ON facts (chain_id, version);

-- Facts are written one at a time, so plain triggers keep the index (unlike chunks).
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

-- A session's summaries roll up: each one covers the whole session so far, and the one it
-- replaces gets superseded_by (kept as history, never recalled).
CREATE TABLE summaries (
    id INTEGER PRIMARY KEY,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    text TEXT NOT NULL,
    data TEXT NOT NULL,
    source_turn_ids TEXT NOT NULL DEFAULT '[]',
    last_turn_id INTEGER NOT NULL,
    user_turns INTEGER NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    superseded_by INTEGER NULL,
    created_at REAL NOT NULL,
    owner TEXT NOT NULL,
    sess TEXT NOT NULL
);
CREATE INDEX summaries_by_session ON summaries (user_id, session_id, id);
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

-- The user-authored profile exists only while consent is on: revoking deletes it.
CREATE TABLE profiles (
    user_id TEXT PRIMARY KEY,
    fields TEXT NOT NULL,
    text TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE consent (
    user_id TEXT PRIMARY KEY,
    profile INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
"""

# Clear-all with an undo window (memory/admin/clearing.py): the cleared memory is kept as export
# records until the window ends; only the undo token's hash is stored.
_CLEARS = """
CREATE TABLE clears (
    id TEXT PRIMARY KEY,
    user_id TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'undone', 'restored', 'purged')),
    removed TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    settled_at REAL NULL
);
CREATE INDEX clears_by_user ON clears (user_id, status, expires_at);
CREATE TABLE clear_records (
    clear_id TEXT NOT NULL REFERENCES clears(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (clear_id, seq)
);
CREATE INDEX request_metrics_by_user ON request_metrics (user_id, created_at);
"""

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
    for table in ("turns", "chunks", "facts", "summaries", "profiles", "consent"):
        for op in ("INSERT", "UPDATE", "DELETE"):
            row = "old" if op == "DELETE" else "new"
            body = bump.format(user=f"{row}.user_id", session="''")
            if op == "INSERT" and table in ("turns", "chunks"):
                body += bump.format(user="new.user_id", session="new.session_id")
            statements.append(
                f"CREATE TRIGGER {table}_version_{op.lower()} AFTER {op} ON {table} BEGIN {body} END;"
            )
    return "\n".join(statements)


# Prompt-cache-safe injection (memory/storage/injections.py): the block a request injected is kept
# with the user turn it was placed at and put back, byte for byte, in the session's later requests.
# A block may show any of the user's memory, so deleting a turn, a fact, a summary or the profile,
# closing a fact's version or changing the profile drops all of the user's blocks: nothing forgotten
# goes back into a prompt (the next request of a session gets a new block, and its cached prefix
# breaks once). Recall cache validity (memory/storage/versions.py): see _version_triggers.
_FORGETTING = (
    ("turns_forget_blocks", "AFTER DELETE ON turns"),
    ("facts_forget_blocks", "AFTER DELETE ON facts"),
    ("facts_close_blocks", "AFTER UPDATE OF valid_to ON facts WHEN new.valid_to IS NOT NULL"),
    ("summaries_forget_blocks", "AFTER DELETE ON summaries"),
    ("profiles_forget_blocks", "AFTER DELETE ON profiles"),
    ("profiles_change_blocks", "AFTER UPDATE ON profiles"),
)


# An organisation's shared fact (memory/scopes.py: its owner id starts with char(31)) is in
# the blocks of its members: forgetting it drops every block that shows it.
_SHARED_FACT_BLOCKS = (
    " DELETE FROM injections WHERE substr(old.user_id, 1, 1) = char(31)"
    " AND items LIKE '%\"f' || old.id || '\"%';"
)


def _forgetting_triggers() -> str:
    return "\n".join(
        f"CREATE TRIGGER {name} {when} BEGIN DELETE FROM injections WHERE user_id = old.user_id;"
        f"{_SHARED_FACT_BLOCKS if name.startswith('facts_') else ''} END;"
        for name, when in _FORGETTING
    )


_INJECTIONS = f"""
CREATE TABLE injections (
    turn_id INTEGER PRIMARY KEY REFERENCES turns(id) ON DELETE CASCADE,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    placement TEXT NOT NULL CHECK (placement IN ('system', 'last_user')),
    block TEXT NOT NULL,
    items TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE memory_versions (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    PRIMARY KEY (user_id, session_id)
);
CREATE INDEX injections_by_user ON injections (user_id);
{_version_triggers()}
{_forgetting_triggers()}
"""

_VECTOR_GENERATIONS = """
CREATE TABLE vector_generations (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    PRIMARY KEY (user_id, session_id)
);
"""

_REPLY_OWNER = "CREATE INDEX turns_by_reply ON turns (request_id, id) WHERE role = 'assistant';"

_FAIR_JOBS = """
ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN fair_at REAL NOT NULL DEFAULT 0;
UPDATE jobs SET fair_at = run_after;
CREATE INDEX jobs_fair ON jobs (status, fair_at, id);
CREATE INDEX jobs_by_owner ON jobs (owner, fair_at) WHERE status IN ('queued', 'running');
"""

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
    ("0003_clears", _CLEARS),
    ("0004_recall", _RECALL),
    # A Responses API request names the reply it continues (previous_response_id): the
    # reply turn's request_id holds that response id, found per user by this index.
    ("0005_reply_lookup", "CREATE INDEX turns_by_request ON turns (user_id, request_id);"),
    ("0006_injections", _INJECTIONS),
    # Per-user vector generations (memory/storage/versions.py): bumped after every write of
    # a user's vectors, so replicas sharing a Chroma server know their copies are stale;
    # rows per session as in memory_versions, for the recall cache.
    ("0007_vector_generations", _VECTOR_GENERATIONS),
    # Recall takes the names a user's turns were said under out of its query
    # (memory/recall/speakers.py): this index finds them one name at a time, not by reading
    # every turn of the user (65 ms at 100k turns).
    ("0008_turn_speakers", "CREATE INDEX turns_by_name ON turns (user_id, name);"),
    # PostgreSQL's chunk postings (memory.storage.postgres_schema); FTS5 keeps its own, so
    # nothing changes here: the name is recorded so both backends list the same migrations.
    ("0009_chunk_postings", lambda conn: None),
    # Whose reply a response id is, whoever asks (proxy/access/ownership.py): the first user a
    # reply turn was stored for under that id.
    ("0010_reply_owner", _REPLY_OWNER),
    # Fair claims between users (memory/storage/jobs.py): a job's owner and its place in
    # the fair order; jobs queued before keep the order they had (fair_at = run_after).
    ("0011_fair_jobs", _FAIR_JOBS),
    # Provenance (docs/mcp.md): a fact added over MCP has source 'mcp' and the name the
    # client gave itself.
    ("0012_fact_provenance", _fact_provenance),
    ("0013_api_keys", _API_KEYS),  # keys in the database (docs/keys.md), stored hashed
    # Usage and quotas (docs/usage.md); 0013 is the stored keys' (issue 24's other half).
    *usage_schema.SQLITE_MIGRATIONS,  # 0014 and 0015: usage, quotas and rate buckets
    ("0016_lasting_ids", lambda conn: autoincrement_ids(conn, ("facts", "summaries"))),
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


async def recorded(conn: Connection) -> int:
    """How many migrations the database records (a read that touches the file)."""
    rows = await conn.fetch("SELECT COUNT(*) FROM migrations")
    return int(rows[0][0])


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
