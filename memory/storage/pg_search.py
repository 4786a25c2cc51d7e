"""Full-text search on PostgreSQL, ranked by the BM25 that FTS5's bm25() computes.

FTS5 scores a row by, for each query word (a phrase) i,

    idf_i * f_i * (k1 + 1) / (f_i + k1 * (1 - b + b * D / avgdl)),  k1 = 1.2, b = 0.75

where f_i sums the column weights of the word's occurrences in the row (text 1.0, a chunk's
speaker 0.5), D is the row's token count (all columns, scope tokens included), avgdl the
table's mean, and idf_i = ln((N - n_i + 0.5) / (n_i + 0.5)) over all N rows of every user,
n_i of which hold the word (1e-6 when that is not positive). The schema
(memory.storage.postgres_schema) keeps D and each word's weighted count f per row, N and the
token total per table, and n_i per word; only the candidates are read row by row. Candidates
are the rows in scope that hold any of the words, as FTS5's `scope AND (w1 OR w2 ...)`.

Chunks, the table every recall searches, are read as FTS5 reads its index: the postings
(chunk_terms: owner, word, chunk, f, D) of the query's words alone, by index. Facts and
summaries, far fewer a user, test their candidates' tsvectors (GIN) and look f up in `tf`.
"""

from __future__ import annotations

_K1 = 1.2
_B = 0.75

# What every search reads first: the query's lexemes and their idf (weights), and the
# table's mean row length (totals). {table}: chunks, facts or summaries. The words are the
# first parameter (a text array).
_WEIGHTS = """
WITH terms AS (
    SELECT lexeme, COUNT(*) AS repeats
    FROM (SELECT memproxy_lexeme(word) AS lexeme FROM unnest(?::text[]) AS word) AS words
    WHERE lexeme IS NOT NULL GROUP BY lexeme
),
totals AS (
    SELECT docs, tokens::float8 / GREATEST(docs, 1) AS avgdl FROM fts_totals WHERE name = '{table}'
),
weights AS MATERIALIZED (
    SELECT t.lexeme, (t.repeats * CASE WHEN raw.idf <= 0 THEN 1e-6 ELSE raw.idf END)::float8 AS idf
    FROM terms AS t CROSS JOIN totals
    LEFT JOIN fts_terms AS hits ON hits.name = '{table}' AND hits.lexeme = t.lexeme
    CROSS JOIN LATERAL (
        SELECT ln((totals.docs - COALESCE(hits.docs, 0) + 0.5) / (COALESCE(hits.docs, 0) + 0.5)) AS idf
    ) AS raw
)"""


def _score(tf: str, doc_len: str) -> str:
    # float8 throughout: a bare 0.75 is NUMERIC, whose arithmetic per posting took a third of
    # a common word's search; the scores are the same bits (0.75 x an integer is exact).
    k1, b = f"{_K1}::float8", f"{_B}::float8"
    return f"w.idf * {tf} * {_K1 + 1}::float8 / ({tf} + {k1} * ({1 - _B}::float8 + {b} * {doc_len} / totals.avgdl))"


# Facts and summaries: the candidates' tsvectors (GIN) and `tf`. {scope}: SQL on the
# table's columns. Parameters: the words, then the scope's, then the limit.
_BM25 = _WEIGHTS + f""",
candidates AS (
    SELECT id, tf, doc_len FROM {{table}}
    WHERE tsv @@ (SELECT string_agg(quote_literal(lexeme), ' | ')::tsquery FROM terms)
        AND {{scope}}
)
SELECT c.id, SUM({_score("f.tf", "c.doc_len")}) AS score
FROM candidates AS c CROSS JOIN totals CROSS JOIN weights AS w
CROSS JOIN LATERAL (SELECT (c.tf ->> w.lexeme)::float8 AS tf) AS f
WHERE f.tf IS NOT NULL
GROUP BY c.id ORDER BY score DESC, c.id LIMIT ?
"""

# Chunks: the postings of the query's lexemes within the user's (session's) rows. {session}:
# empty, or the session test. Parameters: the words, the user, (the session,) the limit.
_CHUNK_BM25 = _WEIGHTS.format(table="chunks") + f"""
SELECT p.chunk_id, SUM({_score("p.tf::float8", "p.doc_len")}) AS score
FROM weights AS w CROSS JOIN totals
JOIN chunk_terms AS p ON p.user_id = ? AND p.lexeme = w.lexeme{{session}}
GROUP BY p.chunk_id ORDER BY score DESC, p.chunk_id LIMIT ?
"""

# Rows of the whole table (every user) that hold each word, in the order given.
_TERM_COUNTS = """
SELECT COALESCE(hits.docs, 0) FROM unnest(?::text[]) WITH ORDINALITY AS words(word, i)
LEFT JOIN fts_terms AS hits ON hits.name = '{table}' AND hits.lexeme = memproxy_lexeme(word)
ORDER BY i
"""


def bm25_sql(table: str, scope: str) -> str:
    """SELECT (id, score) of the best rows of `table` (facts, summaries) within `scope`
    holding any of the words."""
    return _BM25.format(table=table, scope=scope)


def chunk_bm25_sql(*, session: bool) -> str:
    """SELECT (chunk id, score) of the user's (session's) best chunks holding any of the words."""
    return _CHUNK_BM25.format(session=" AND p.session_id = ?" if session else "")


def term_counts_sql(table: str) -> str:
    """SELECT one row per word: how many rows of `table` hold it."""
    return _TERM_COUNTS.format(table=table)


MATCHES = "tsv @@ memproxy_query(?::text[])"  # a row holds any of the words (a text array)
