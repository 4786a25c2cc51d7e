"""The PostgreSQL schema: the SQLite migrations (memory.storage.migrations), same names, same
tables and constraints. The tables both have are declared once (memory.storage.schema, which
also says how the types differ); this adds what only PostgreSQL has.

What differs, and why:
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

from memory.storage import schema

if TYPE_CHECKING:
    import asyncpg

# Any fixed number: the advisory lock all replicas take while they migrate.
_MIGRATION_LOCK = 7_305_210_411

_WORDS = """
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
"""


def _searched(table: str, scope_tokens: int) -> str:
    """The words of a searched table's rows (the module docstring), set by a trigger from
    their text; doc_len also counts the scope tokens FTS5 indexes with each row (owner, and
    sess where the table has it)."""
    return f"""
ALTER TABLE {table} ADD COLUMN tsv tsvector NOT NULL, ADD COLUMN doc_len INTEGER NOT NULL,
    ADD COLUMN tf JSONB NOT NULL;
CREATE INDEX {table}_tsv ON {table} USING GIN (tsv);
CREATE FUNCTION {table}_tsv() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.tsv := setweight(memproxy_words(NEW.text), 'A');
    NEW.doc_len := memproxy_tokens(NEW.tsv) + {scope_tokens};
    NEW.tf := memproxy_tf(NEW.tsv);
    RETURN NEW;
END $$;
CREATE TRIGGER {table}_tsv BEFORE INSERT OR UPDATE OF text ON {table}
    FOR EACH ROW EXECUTE FUNCTION {table}_tsv();
CREATE TRIGGER {table}_count AFTER INSERT OR UPDATE OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION fts_count();
"""


# jobs has `lease_until` (the module docstring).
_INITIAL = (
    _WORDS + schema.SESSIONS + schema.TURNS + schema.CHUNKS
    + "CREATE INDEX chunks_by_user ON chunks (user_id, session_id);\n"
    + _searched("chunks", scope_tokens=2) + schema.JOBS_AND_METRICS
    + "ALTER TABLE jobs ADD COLUMN lease_until DOUBLE PRECISION NULL;\n"
)

_FACTS = (
    schema.FACTS + _searched("facts", scope_tokens=1)
    + schema.SUMMARIES + _searched("summaries", scope_tokens=2) + schema.PROFILES
)

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

# Stable injection and the recall cache (memory.storage.schema, INJECTIONS, which explains the
# triggers): the same tables, and one trigger function each for the write counters and for
# dropping the blocks that showed forgotten memory (an organisation's shared fact is in its
# members' blocks: those that show it go too).
_INJECTIONS = schema.INJECTIONS + """
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
    for table in schema.VERSIONED
) + """
CREATE FUNCTION injections_forget() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM injections WHERE user_id = OLD.user_id;
    IF TG_TABLE_NAME = 'facts' AND left(OLD.user_id, 1) = chr(31) THEN
        DELETE FROM injections WHERE items LIKE '%"f' || OLD.id || '"%';
    END IF;
    RETURN NULL;
END $$;
""" + "".join(
    f"CREATE TRIGGER {name} {event}\n    FOR EACH ROW{f' WHEN ({rows})' if rows else ''}"
    " EXECUTE FUNCTION injections_forget();\n"
    for name, event, rows in schema.FORGETTING
)

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
    ("0003_clears", schema.CLEARS),
    ("0004_recall", _RECALL),
    ("0005_reply_lookup", schema.REPLY_LOOKUP),
    ("0006_injections", _INJECTIONS),
    ("0007_vector_generations", schema.VECTOR_GENERATIONS),
    ("0008_turn_speakers", schema.TURN_SPEAKERS),
    ("0009_chunk_postings", _CHUNK_POSTINGS),
    ("0010_reply_owner", schema.REPLY_OWNER),
    ("0011_fair_jobs", schema.FAIR_JOBS),
    ("0012_fact_provenance", """
ALTER TABLE facts DROP CONSTRAINT facts_source_check;
ALTER TABLE facts ADD CONSTRAINT facts_source_check
    CHECK (source IN ('extracted', 'manual', 'import', 'mcp'));
ALTER TABLE facts ADD COLUMN client TEXT NULL;
"""),
    ("0013_api_keys", schema.API_KEYS),
    ("0014_usage", schema.USAGE),
    ("0015_quota_holds", schema.QUOTA_HOLDS),
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
