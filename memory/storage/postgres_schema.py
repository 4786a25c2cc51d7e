"""The PostgreSQL schema: the SQLite migrations (memory.storage.migrations), same names, same
tables and constraints, in PostgreSQL's words.

What differs, and why:
- ids are BIGSERIAL, times DOUBLE PRECISION; JSON stays TEXT, flags stay 0/1 INTEGERs, so
  every table function reads the same values on both backends.
- Full text: instead of FTS5 tables, each searched table (chunks, facts, summaries) carries
  a `tsv` (GIN-indexed), `doc_len` (its words) and `tf` (each word's weighted count), set by
  a trigger; `fts_totals` keeps each table's row and word counts and `fts_terms` how many
  rows hold each word. That is everything FTS5's bm25() reads, so memory.storage.pg_search
  ranks with the same formula. The counters are hot rows, which costs nothing more because
  writes are serialized anyway (memory.storage.postgres). Words are split and stemmed as FTS5's `porter unicode61` does (see
  memproxy_words). User and session scoping are plain columns, not FTS tokens.
- jobs has `lease_until`: a running job whose lease ended (its replica died) is claimed again.

`apply()` runs under a session advisory lock, so replicas starting together migrate once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memory.storage import api_keys, usage_schema

if TYPE_CHECKING:
    import asyncpg

# Any fixed number: the advisory lock all replicas take while they migrate.
_MIGRATION_LOCK = 7_305_210_411

_INITIAL = """
-- FTS5's tokenizer `porter unicode61`, word for word: split at every character that is not
-- a letter or a digit, lower-case, and stem with the original Porter algorithm (Snowball
-- ships it) except words under 3 or over 64 characters, which FTS5 keeps as they are; no
-- stopwords. Written out instead of a text search configuration because PostgreSQL's parser
-- keeps emails, paths and URLs whole. (unicode61 also folds diacritics; this does not.)
CREATE TEXT SEARCH DICTIONARY memproxy_stem (TEMPLATE = snowball, Language = porter);
CREATE FUNCTION memproxy_words(body TEXT) RETURNS tsvector LANGUAGE sql IMMUTABLE AS $$
    SELECT COALESCE(string_agg(quote_literal(lexeme) || ':' || LEAST(i, 16383), ' ')::tsvector,
                    ''::tsvector)
    FROM (
        SELECT i, CASE WHEN length(w) < 3 OR length(w) > 64 OR stem = w THEN w
                       -- Porter undoubles any final consonant but l, s, z; Snowball's
                       -- version only bb dd ff gg mm nn pp rr tt ("trekked": trek).
                       ELSE regexp_replace(stem, '([chjkqvwx])\\1$', '\\1') END AS lexeme
        FROM regexp_split_to_table(lower(body), '[^[:alnum:]]+') WITH ORDINALITY AS t(w, i),
            LATERAL (SELECT COALESCE((ts_lexize('memproxy_stem', w))[1], w) AS stem) AS s
        WHERE w <> '' AND octet_length(w) < 2048  -- longer words do not fit in a tsvector
    ) AS words
$$;

-- The first lexeme of one query word, and the OR of the lexemes of a list of words.
CREATE FUNCTION memproxy_lexeme(word TEXT) RETURNS TEXT LANGUAGE sql IMMUTABLE AS
    $$ SELECT (tsvector_to_array(memproxy_words(word)))[1] $$;
CREATE FUNCTION memproxy_query(words TEXT[]) RETURNS tsquery LANGUAGE sql IMMUTABLE AS
    $$ SELECT string_agg(quote_literal(memproxy_lexeme(w)), ' | ')::tsquery
       FROM unnest(words) AS w WHERE memproxy_lexeme(w) IS NOT NULL $$;
-- How many words a tsvector holds (every occurrence, like FTS5's column sizes), and each
-- word's count weighted as bm25() weighs columns: 1 in the text (weight A), 0.5 in a chunk's
-- speaker name (weight B).
CREATE FUNCTION memproxy_tokens(v tsvector) RETURNS INTEGER LANGUAGE sql IMMUTABLE AS
    $$ SELECT COALESCE(SUM(cardinality(positions)), 0)::INTEGER FROM unnest(v) $$;
CREATE FUNCTION memproxy_tf(v tsvector) RETURNS JSONB LANGUAGE sql IMMUTABLE AS $$
    SELECT COALESCE(jsonb_object_agg(
        lexeme, cardinality(weights) - 0.5 * cardinality(array_remove(weights, 'A'))), '{}')
    FROM unnest(v)
$$;

CREATE TABLE fts_totals (
    name TEXT PRIMARY KEY,
    docs BIGINT NOT NULL,
    tokens BIGINT NOT NULL
);
INSERT INTO fts_totals VALUES ('chunks', 0, 0), ('facts', 0, 0), ('summaries', 0, 0);
CREATE TABLE fts_terms (
    name TEXT NOT NULL,
    lexeme TEXT NOT NULL,
    docs BIGINT NOT NULL,
    PRIMARY KEY (name, lexeme)
);
CREATE FUNCTION fts_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.tsv = OLD.tsv THEN
        RETURN NULL;
    END IF;
    IF TG_OP IN ('DELETE', 'UPDATE') THEN
        UPDATE fts_totals SET docs = docs - 1, tokens = tokens - OLD.doc_len WHERE name = TG_TABLE_NAME;
        UPDATE fts_terms SET docs = docs - 1
            WHERE name = TG_TABLE_NAME AND lexeme = ANY(tsvector_to_array(OLD.tsv));
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        UPDATE fts_totals SET docs = docs + 1, tokens = tokens + NEW.doc_len WHERE name = TG_TABLE_NAME;
        INSERT INTO fts_terms (name, lexeme, docs)
            SELECT TG_TABLE_NAME, lexeme, 1 FROM unnest(tsvector_to_array(NEW.tsv)) AS lexeme
            ON CONFLICT (name, lexeme) DO UPDATE SET docs = fts_terms.docs + 1;
    END IF;
    RETURN NULL;
END $$;

CREATE TABLE sessions (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    last_active DOUBLE PRECISION NOT NULL,
    turn_count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (user_id, session_id)
);

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
-- Exactly-once logging, as on SQLite: one row per (branch point, content).
CREATE UNIQUE INDEX turns_path ON turns (user_id, session_id, COALESCE(parent_id, 0), content_hash);
CREATE INDEX turns_by_hash ON turns (user_id, session_id, content_hash);

-- doc_len counts the owner and session tokens FTS5 indexes with each chunk (2).
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
    tsv tsvector NOT NULL,
    doc_len INTEGER NOT NULL,
    tf JSONB NOT NULL,
    UNIQUE (turn_id, ordinal)
);
CREATE INDEX chunks_by_user ON chunks (user_id, session_id);
CREATE INDEX chunks_tsv ON chunks USING GIN (tsv);
CREATE FUNCTION chunks_tsv() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.tsv := setweight(memproxy_words(NEW.text), 'A');
    NEW.doc_len := memproxy_tokens(NEW.tsv) + 2;
    NEW.tf := memproxy_tf(NEW.tsv);
    RETURN NEW;
END $$;
CREATE TRIGGER chunks_tsv BEFORE INSERT OR UPDATE OF text ON chunks
    FOR EACH ROW EXECUTE FUNCTION chunks_tsv();
CREATE TRIGGER chunks_count AFTER INSERT OR UPDATE OR DELETE ON chunks
    FOR EACH ROW EXECUTE FUNCTION fts_count();

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
    updated_at DOUBLE PRECISION NOT NULL,
    lease_until DOUBLE PRECISION NULL
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

_FACTS = """
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
    owner TEXT NOT NULL,
    tsv tsvector NOT NULL,
    doc_len INTEGER NOT NULL,
    tf JSONB NOT NULL
);
CREATE INDEX facts_by_user ON facts (user_id, valid_to, id);
CREATE INDEX facts_by_chain ON facts (chain_id, version);
CREATE INDEX facts_tsv ON facts USING GIN (tsv);
-- doc_len counts the owner token FTS5 indexes with each fact (1).
CREATE FUNCTION facts_tsv() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.tsv := setweight(memproxy_words(NEW.text), 'A');
    NEW.doc_len := memproxy_tokens(NEW.tsv) + 1;
    NEW.tf := memproxy_tf(NEW.tsv);
    RETURN NEW;
END $$;
CREATE TRIGGER facts_tsv BEFORE INSERT OR UPDATE OF text ON facts
    FOR EACH ROW EXECUTE FUNCTION facts_tsv();
CREATE TRIGGER facts_count AFTER INSERT OR UPDATE OR DELETE ON facts
    FOR EACH ROW EXECUTE FUNCTION fts_count();

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
    sess TEXT NOT NULL,
    tsv tsvector NOT NULL,
    doc_len INTEGER NOT NULL,
    tf JSONB NOT NULL
);
CREATE INDEX summaries_by_session ON summaries (user_id, session_id, id);
CREATE INDEX summaries_tsv ON summaries USING GIN (tsv);
-- doc_len counts the owner and session tokens FTS5 indexes with each summary (2).
CREATE FUNCTION summaries_tsv() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.tsv := setweight(memproxy_words(NEW.text), 'A');
    NEW.doc_len := memproxy_tokens(NEW.tsv) + 2;
    NEW.tf := memproxy_tf(NEW.tsv);
    RETURN NEW;
END $$;
CREATE TRIGGER summaries_tsv BEFORE INSERT OR UPDATE OF text ON summaries
    FOR EACH ROW EXECUTE FUNCTION summaries_tsv();
CREATE TRIGGER summaries_count AFTER INSERT OR UPDATE OR DELETE ON summaries
    FOR EACH ROW EXECUTE FUNCTION fts_count();

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

_CLEARS = """
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

# The speaker is indexed with the chunk's text at half a text word's weight (FTS5's
# bm25(1.0, 0.5, ...)): weight B marks its words.
_RECALL = """
ALTER TABLE chunks ADD COLUMN speaker TEXT NOT NULL DEFAULT '';
CREATE OR REPLACE FUNCTION chunks_tsv() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.tsv := setweight(memproxy_words(NEW.text), 'A')
        || setweight(memproxy_words(NEW.speaker), 'B');
    NEW.doc_len := memproxy_tokens(NEW.tsv) + 2;
    NEW.tf := memproxy_tf(NEW.tsv);
    RETURN NEW;
END $$;
DROP TRIGGER chunks_tsv ON chunks;
CREATE TRIGGER chunks_tsv BEFORE INSERT OR UPDATE OF text, speaker ON chunks
    FOR EACH ROW EXECUTE FUNCTION chunks_tsv();
CREATE INDEX turns_by_parent ON turns (parent_id);
"""

# Stable injection and the recall cache (SQLite: migrations._INJECTIONS, which explains the
# triggers): the same tables, and one trigger function each for the write counters and for
# dropping the blocks that showed forgotten memory (an organisation's shared fact is in its
# members' blocks: those that show it go too).
_INJECTIONS = """
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
CREATE FUNCTION memory_version_bump() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r RECORD;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    INSERT INTO memory_versions VALUES (r.user_id, '', 1)
        ON CONFLICT (user_id, session_id) DO UPDATE SET version = memory_versions.version + 1;
    IF TG_OP = 'INSERT' AND TG_TABLE_NAME IN ('turns', 'chunks') THEN
        INSERT INTO memory_versions VALUES (r.user_id, r.session_id, 1)
            ON CONFLICT (user_id, session_id)
            DO UPDATE SET version = memory_versions.version + 1;
    END IF;
    RETURN NULL;
END $$;
""" + "".join(
    f"CREATE TRIGGER {table}_version AFTER INSERT OR UPDATE OR DELETE ON {table}"
    " FOR EACH ROW EXECUTE FUNCTION memory_version_bump();\n"
    for table in ("turns", "chunks", "facts", "summaries", "profiles", "consent")
) + """
CREATE FUNCTION injections_forget() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM injections WHERE user_id = OLD.user_id;
    IF TG_TABLE_NAME = 'facts' AND left(OLD.user_id, 1) = chr(31) THEN
        DELETE FROM injections WHERE items LIKE '%"f' || OLD.id || '"%';
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER turns_forget_blocks AFTER DELETE ON turns
    FOR EACH ROW EXECUTE FUNCTION injections_forget();
CREATE TRIGGER facts_forget_blocks AFTER DELETE ON facts
    FOR EACH ROW EXECUTE FUNCTION injections_forget();
CREATE TRIGGER facts_close_blocks AFTER UPDATE OF valid_to ON facts
    FOR EACH ROW WHEN (NEW.valid_to IS NOT NULL) EXECUTE FUNCTION injections_forget();
CREATE TRIGGER summaries_forget_blocks AFTER DELETE ON summaries
    FOR EACH ROW EXECUTE FUNCTION injections_forget();
CREATE TRIGGER profiles_forget_blocks AFTER DELETE ON profiles
    FOR EACH ROW EXECUTE FUNCTION injections_forget();
CREATE TRIGGER profiles_change_blocks AFTER UPDATE ON profiles
    FOR EACH ROW EXECUTE FUNCTION injections_forget();
"""

# Chunks' full text as postings, FTS5's own layout: one row per (chunk, word) with the word's
# weighted count and the chunk's length, keyed by owner and word, so a search reads the
# postings of its few words by index (memory.storage.pg_search) instead of testing each
# candidate's tsvector and looking its words up in `tf` (15 ms for 900 candidates x 25
# words at 10k turns). The GIN index it replaces cost up to 17 ms more right after a burst of
# writes: with fastupdate on, every search scanned the unsorted pending list (up to 4 MB);
# facts' and summaries' GIN indexes, still searched, now skip that list. Filled by a trigger
# (so `memproxy migrate` copies nothing into it) and, here, from the chunks already indexed.
_CHUNK_POSTINGS = """
CREATE TABLE chunk_terms (
    user_id TEXT NOT NULL,
    lexeme TEXT NOT NULL,
    chunk_id BIGINT NOT NULL,
    session_id TEXT NOT NULL,
    tf REAL NOT NULL,
    doc_len INTEGER NOT NULL,
    PRIMARY KEY (user_id, lexeme, chunk_id) INCLUDE (session_id, tf, doc_len)
);
CREATE FUNCTION chunk_terms_sync() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.tsv = OLD.tsv AND NEW.user_id = OLD.user_id
            AND NEW.session_id = OLD.session_id THEN
        RETURN NULL;
    END IF;
    IF TG_OP IN ('DELETE', 'UPDATE') THEN
        DELETE FROM chunk_terms WHERE user_id = OLD.user_id
            AND lexeme = ANY(tsvector_to_array(OLD.tsv)) AND chunk_id = OLD.id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        INSERT INTO chunk_terms
            SELECT NEW.user_id, t.key, NEW.id, NEW.session_id, t.value::REAL, NEW.doc_len
            FROM jsonb_each_text(NEW.tf) AS t;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chunks_postings AFTER INSERT OR UPDATE OR DELETE ON chunks
    FOR EACH ROW EXECUTE FUNCTION chunk_terms_sync();
INSERT INTO chunk_terms
    SELECT c.user_id, t.key, c.id, c.session_id, t.value::REAL, c.doc_len
    FROM chunks AS c CROSS JOIN LATERAL jsonb_each_text(c.tf) AS t;
DROP INDEX chunks_tsv;
ALTER INDEX facts_tsv SET (fastupdate = off);
ALTER INDEX summaries_tsv SET (fastupdate = off);
"""

MIGRATIONS: list[tuple[str, str]] = [
    ("0001_initial", _INITIAL),
    ("0002_facts", _FACTS),
    ("0003_clears", _CLEARS),
    ("0004_recall", _RECALL),
    ("0005_reply_lookup", "CREATE INDEX turns_by_request ON turns (user_id, request_id);"),
    ("0006_injections", _INJECTIONS),
    ("0007_vector_generations", """
CREATE TABLE vector_generations (
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    generation BIGINT NOT NULL,
    PRIMARY KEY (user_id, session_id)
);
"""),
    ("0008_turn_speakers", "CREATE INDEX turns_by_name ON turns (user_id, name);"),
    ("0009_chunk_postings", _CHUNK_POSTINGS),
    ("0010_reply_owner",
     "CREATE INDEX turns_by_reply ON turns (request_id, id) WHERE role = 'assistant';"),
    ("0011_fair_jobs", """
ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN fair_at DOUBLE PRECISION NOT NULL DEFAULT 0;
UPDATE jobs SET fair_at = run_after;
CREATE INDEX jobs_fair ON jobs (status, fair_at, id);
CREATE INDEX jobs_by_owner ON jobs (owner, fair_at) WHERE status IN ('queued', 'running');
"""),
    ("0012_fact_provenance", """
ALTER TABLE facts DROP CONSTRAINT facts_source_check;
ALTER TABLE facts ADD CONSTRAINT facts_source_check
    CHECK (source IN ('extracted', 'manual', 'import', 'mcp'));
ALTER TABLE facts ADD COLUMN client TEXT NULL;
"""),
    ("0013_api_keys", api_keys.POSTGRES_TABLE),
    *usage_schema.POSTGRES_MIGRATIONS,
    ("0016_lasting_ids", "SELECT 1;"),  # SQLite's AUTOINCREMENT: BIGSERIAL never reuses ids
]


async def apply(
    conn: asyncpg.Connection, migrations: Sequence[tuple[str, str]] = MIGRATIONS
) -> list[str]:
    """Apply the migrations not yet recorded, in order, and return their names."""
    newly_applied = []
    await conn.execute("SELECT pg_advisory_lock($1)", _MIGRATION_LOCK)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS migrations"
            " (name TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
        )
        done = {row[0] for row in await conn.fetch("SELECT name FROM migrations")}
        for name, script in migrations:
            if name in done:
                continue
            # Each migration commits together with the row that records it.
            async with conn.transaction():
                await conn.execute(script)
                await conn.execute("INSERT INTO migrations (name, applied_at) VALUES ($1, $2)", name, time.time())
            newly_applied.append(name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
    return newly_applied


async def applied(conn: asyncpg.Connection) -> list[str]:
    """Names of the migrations recorded in the database, in the order they ran."""
    rows = await conn.fetch("SELECT name FROM migrations ORDER BY applied_at, name")
    return [str(row[0]) for row in rows]
