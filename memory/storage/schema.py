"""The tables both backends create, declared once, in PostgreSQL's types; `for_sqlite()` gives
SQLite's spelling of them.

Each backend's migrations (memory.storage.migrations, memory.storage.postgres_schema) run
these beside what only that backend has: FTS5's tables and SQLite's triggers there, the
tsvector columns and trigger functions here. Every declaration is part of a migration that
has shipped, on both backends: never edit one; add a new migration instead.

The types differ this much and no more: an id the database hands out is BIGSERIAL (SQLite:
INTEGER PRIMARY KEY, its rowid), 64-bit integers are BIGINT and times DOUBLE PRECISION
(SQLite: INTEGER and REAL, which hold as much). JSON stays TEXT and flags stay 0/1 INTEGERs
on both, so every table function reads the same values on both backends.
"""

from __future__ import annotations

_SQLITE_TYPES = (
    ("BIGSERIAL PRIMARY KEY", "INTEGER PRIMARY KEY"),
    ("BIGINT", "INTEGER"),
    ("DOUBLE PRECISION", "REAL"),
)


def for_sqlite(sql: str) -> str:
    """`sql` with SQLite's names for PostgreSQL's types."""
    for postgres, sqlite in _SQLITE_TYPES:
        sql = sql.replace(postgres, sqlite)
    return sql


# -- 0001_initial ------------------------------------------------------------------------------

SESSIONS = """
CREATE TABLE sessions (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    last_active DOUBLE PRECISION NOT NULL,
    turn_count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (user_id, session_id)
);
"""

TURNS = """
CREATE TABLE turns (
    id BIGSERIAL PRIMARY KEY,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    parent_id BIGINT NULL REFERENCES turns(id),
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    name TEXT NULL,
    content TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    model TEXT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    request_id TEXT NULL,
    incomplete INTEGER NOT NULL DEFAULT 0
);
-- Exactly-once logging: one row per (conversation branch point, content).
-- COALESCE because NULLs are distinct in UNIQUE indexes.
CREATE UNIQUE INDEX turns_path ON turns (user_id, session_id, COALESCE(parent_id, 0), content_hash);
CREATE INDEX turns_by_hash ON turns (user_id, session_id, content_hash);
"""

# owner/sess hold one FTS5 token each, so on SQLite user and session scoping happen inside
# MATCH; PostgreSQL scopes by the plain columns.
CHUNKS = """
CREATE TABLE chunks (
    id BIGSERIAL PRIMARY KEY,
    turn_id BIGINT NOT NULL REFERENCES turns(id) ON DELETE CASCADE,
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
"""

JOBS_AND_METRICS = """
CREATE TABLE jobs (
    id BIGSERIAL PRIMARY KEY,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'done', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    run_after DOUBLE PRECISION NOT NULL,
    last_error TEXT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX jobs_ready ON jobs (status, run_after, id);

CREATE TABLE request_metrics (
    id BIGSERIAL PRIMARY KEY,
    created_at DOUBLE PRECISION NOT NULL,
    user_id TEXT NOT NULL,
    session_id TEXT NULL,
    request_id TEXT NULL,
    model TEXT NULL,
    items_json TEXT NOT NULL,
    injected_tokens INTEGER NOT NULL DEFAULT 0,
    truncated INTEGER NOT NULL DEFAULT 0,
    recall_ms DOUBLE PRECISION NULL,
    embed_ms DOUBLE PRECISION NULL,
    error TEXT NULL
);
CREATE INDEX request_metrics_created ON request_metrics (created_at);
"""

# -- 0002_facts --------------------------------------------------------------------------------

# Learned memory (docs/memory.md, Learning). A fact's versions share `chain_id` (the id of its
# first version): an edit or a contradiction inserts a new row and closes the old one with
# `valid_to` + `superseded_by`, so history is kept and a delete removes the whole chain.
# previous_id / superseded_by are not foreign keys: a chain is deleted in one statement.
FACTS = """
CREATE TABLE facts (
    id BIGSERIAL PRIMARY KEY,
    chain_id BIGINT NOT NULL,
    user_id TEXT NOT NULL,
    text TEXT NOT NULL,
    category TEXT NOT NULL CHECK (category IN ('identity', 'preference', 'project',
        'relationship', 'context', 'todo', 'decision')),
    confidence DOUBLE PRECISION NOT NULL,
    importance INTEGER NOT NULL,
    mentions INTEGER NOT NULL DEFAULT 1,
    source TEXT NOT NULL CHECK (source IN ('extracted', 'manual', 'import')),
    source_session TEXT NULL,
    source_turn_ids TEXT NOT NULL DEFAULT '[]',
    pinned INTEGER NOT NULL DEFAULT 0,
    first_seen DOUBLE PRECISION NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NULL,
    version INTEGER NOT NULL DEFAULT 1,
    previous_id BIGINT NULL,
    valid_from DOUBLE PRECISION NOT NULL,
    valid_to DOUBLE PRECISION NULL,
    superseded_by BIGINT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    owner TEXT NOT NULL
);
CREATE INDEX facts_by_user ON facts (user_id, valid_to, id);
CREATE INDEX facts_by_chain ON facts (chain_id, version);
"""

# A session's summaries roll up: each one covers the whole session so far, and the one it
# replaces gets superseded_by (kept as history, never recalled).
SUMMARIES = """
CREATE TABLE summaries (
    id BIGSERIAL PRIMARY KEY,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    text TEXT NOT NULL,
    data TEXT NOT NULL,
    source_turn_ids TEXT NOT NULL DEFAULT '[]',
    last_turn_id BIGINT NOT NULL,
    user_turns INTEGER NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    superseded_by BIGINT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    owner TEXT NOT NULL,
    sess TEXT NOT NULL
);
CREATE INDEX summaries_by_session ON summaries (user_id, session_id, id);
"""

# The user-authored profile exists only while consent is on: revoking deletes it.
PROFILES = """
CREATE TABLE profiles (
    user_id TEXT PRIMARY KEY,
    fields TEXT NOT NULL,
    text TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE consent (
    user_id TEXT PRIMARY KEY,
    profile INTEGER NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
"""

# -- 0003_clears -------------------------------------------------------------------------------

# Clear-all with an undo window (memory/admin/clearing.py): the cleared memory is kept as export
# records until the window ends; only the undo token's hash is stored.
CLEARS = """
CREATE TABLE clears (
    id TEXT PRIMARY KEY,
    user_id TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'undone', 'restored', 'purged')),
    removed TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    settled_at DOUBLE PRECISION NULL
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

# -- 0005 to 0011 ------------------------------------------------------------------------------

REPLY_LOOKUP = "CREATE INDEX turns_by_request ON turns (user_id, request_id);"

# Prompt-cache-safe injection (memory/storage/injections.py) and the recall cache's write
# counters (memory/storage/versions.py); each backend's triggers keep them.
INJECTIONS = """
CREATE TABLE injections (
    turn_id BIGINT PRIMARY KEY REFERENCES turns(id) ON DELETE CASCADE,
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    placement TEXT NOT NULL CHECK (placement IN ('system', 'last_user')),
    block TEXT NOT NULL,
    items TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE memory_versions (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    version BIGINT NOT NULL,
    PRIMARY KEY (user_id, session_id)
);
CREATE INDEX injections_by_user ON injections (user_id);
"""

# The triggers that keep them, which each backend writes in its own words: every write to
# these tables counts in `memory_versions` (memory.storage.migrations._version_triggers says
# how and why) ...
VERSIONED = ("turns", "chunks", "facts", "summaries", "profiles", "consent")

# ... and the block a request injected is kept with the user turn it was placed at and put
# back, byte for byte, in the session's later requests. A block may show any of the user's
# memory, so deleting a turn, a fact, a summary or the profile, closing a fact's version or
# changing the profile drops all of the user's blocks: nothing forgotten goes back into a
# prompt (the next request of a session gets a new block, and its cached prefix breaks once).
# (trigger, event, the rows it fires for: all when empty)
FORGETTING = (
    ("turns_forget_blocks", "AFTER DELETE ON turns", ""),
    ("facts_forget_blocks", "AFTER DELETE ON facts", ""),
    ("facts_close_blocks", "AFTER UPDATE OF valid_to ON facts", "new.valid_to IS NOT NULL"),
    ("summaries_forget_blocks", "AFTER DELETE ON summaries", ""),
    ("profiles_forget_blocks", "AFTER DELETE ON profiles", ""),
    ("profiles_change_blocks", "AFTER UPDATE ON profiles", ""),
)

VECTOR_GENERATIONS = """
CREATE TABLE vector_generations (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    generation BIGINT NOT NULL,
    PRIMARY KEY (user_id, session_id)
);
"""

TURN_SPEAKERS = "CREATE INDEX turns_by_name ON turns (user_id, name);"

REPLY_OWNER = "CREATE INDEX turns_by_reply ON turns (request_id, id) WHERE role = 'assistant';"

FAIR_JOBS = """
ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN fair_at DOUBLE PRECISION NOT NULL DEFAULT 0;
UPDATE jobs SET fair_at = run_after;
CREATE INDEX jobs_fair ON jobs (status, fair_at, id);
CREATE INDEX jobs_by_owner ON jobs (owner, fair_at) WHERE status IN ('queued', 'running');
"""

# -- 0013 to 0015 ------------------------------------------------------------------------------

# Proxy keys kept in the database (memory/storage/api_keys.py, docs/keys.md), stored hashed.
API_KEYS = """
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    digest TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    user_id TEXT NULL,
    org_id TEXT NULL,
    org_writer INTEGER NOT NULL DEFAULT 0 CHECK (org_writer IN (0, 1)),
    expires_at DOUBLE PRECISION NULL,
    rate_limit BIGINT NULL CHECK (rate_limit IS NULL OR rate_limit > 0),
    token_quota BIGINT NULL CHECK (token_quota IS NULL OR token_quota >= 0),
    created_at DOUBLE PRECISION NOT NULL,
    last_used_at DOUBLE PRECISION NULL,
    revoked_at DOUBLE PRECISION NULL
);
CREATE INDEX api_keys_by_org ON api_keys (org_id, user_id);
"""

# `usage_daily` (memory/storage/usage.py), one row per day (UTC), key and user; the quota
# reads a key's month through usage_by_key. A busy key's month of tokens outgrows 32 bits.
USAGE = """
CREATE TABLE usage_daily (
    day TEXT NOT NULL,
    key_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    requests BIGINT NOT NULL DEFAULT 0,
    input_tokens BIGINT NOT NULL DEFAULT 0,
    output_tokens BIGINT NOT NULL DEFAULT 0,
    memory_tokens BIGINT NOT NULL DEFAULT 0,
    errors BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (day, key_id, user_id)
);
CREATE INDEX usage_by_key ON usage_daily (key_id, day);
"""

# `usage_reservations` (memory/storage/reservations.py), the tokens each running request of a
# quota key holds, and `rate_buckets` (memory/storage/rate_buckets.py), each proxy key's
# request-rate bucket shared by every replica (docs/usage.md, docs/keys.md). A reservation
# carries its own expiry (a lease), so one left by a replica that died stops counting when
# its lease ends (LEASE_SECONDS, proxy/access/quota.py) without anyone releasing it.
QUOTA_HOLDS = """
CREATE TABLE usage_reservations (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    tokens BIGINT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX reservations_by_key ON usage_reservations (key_id, expires_at);
CREATE INDEX reservations_by_expiry ON usage_reservations (expires_at);
CREATE TABLE rate_buckets (
    bucket TEXT PRIMARY KEY,
    tokens DOUBLE PRECISION NOT NULL,
    updated DOUBLE PRECISION NOT NULL
);
"""
