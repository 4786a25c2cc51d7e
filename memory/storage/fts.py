"""FTS5 query text: the words of free text, and the scope tokens that keep a search inside
one user's (and one session's) rows. Used by the table modules that search (turns' chunks,
facts, summaries); a PostgreSQL backend would build tsquery text here instead."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

_MAX_QUERY_TERMS = 32
# Columns of chunks_fts that query words match (the text, and the speaker's name).
CHUNK_COLUMNS = ("text", "speaker")
_WORD = re.compile(r"[^\W_]+")
_STOPWORDS = frozenset(
    "a an and are as at be but by did do does for from had has have he her his how i if in "
    "into is it its me my no not of on or our she so than that the their them then there "
    "these they this to was we were what when where which who why will with you your".split()
)


def owner_token(user_id: str) -> str:
    """The FTS token that scopes rows to one user."""
    return "u" + _digits(user_id)


def session_token(user_id: str, session_id: str) -> str:
    """The FTS token that scopes rows to one session of one user."""
    return "s" + _digits(f"{user_id}\x00{session_id}")


def _digits(value: str) -> str:
    # Digits only: the porter stemmer rewrites letter suffixes ("...ed"), digits never.
    # 80 bits of sha256 keep collisions negligible at any realistic user count.
    number = int.from_bytes(hashlib.sha256(value.encode()).digest()[:10], "big")
    return f"{number:025d}"


def search_terms(query: str) -> list[str]:
    """Distinct lower-cased words of free text, stopwords dropped, capped in number."""
    terms = dict.fromkeys(w for w in _WORD.findall(query.lower()) if w not in _STOPWORDS)
    return list(terms)[:_MAX_QUERY_TERMS]


def text_words(text: str) -> set[str]:
    """Every distinct lower-cased word of `text` (what `search_terms` would look for)."""
    return set(_WORD.findall(text.lower()))


def match_expression(
    user_id: str, query: str, session_id: str | None = None, *, columns: Sequence[str] = ("text",)
) -> str | None:
    """FTS5 MATCH text for free text within a user (and session) scope; None if no terms.

    `columns` are the indexed columns the words may match (all of them rank; see the
    table's bm25 weights).
    """
    terms = search_terms(query)
    if not terms:
        return None
    # Every term is a quoted string, so user text can never be read as FTS5 syntax.
    alternatives = " OR ".join(quote(term) for term in terms)
    scope = f'owner:"{owner_token(user_id)}"'
    if session_id is not None:
        scope += f' AND sess:"{session_token(user_id, session_id)}"'
    return f"{scope} AND {{{' '.join(columns)}}}:({alternatives})"


def term_expression(term: str, columns: Sequence[str]) -> str:
    """FTS5 MATCH text for one word in any of `columns`, whoever's row it is."""
    return f"{{{' '.join(columns)}}}:{quote(term)}"


def quote(term: str) -> str:
    """`term` as an FTS5 string, so it can never be read as query syntax."""
    return '"' + term.replace('"', '""') + '"'
