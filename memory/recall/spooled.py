"""Recall of turns still waiting in the local spool (memory.log.spooling).

While the database is unreachable, a session's new turns wait in the spool, and the search
indexes (FTS, vectors) cannot hold them yet: a user who keeps talking through an outage
would be forgotten within their own session. So recall reads the request's session in the
spool too, and matches it by words only (the turns are not embedded until they are indexed):

- the database answers but has not taken them all yet: they join recall's candidates;
- the database is unreachable: recall's searches fail, and the block is made of them alone
  (`SpoolRecall`, which the proxy injects and still reports as a recall error).

Only the request's own user and session are read (the spool is keyed by both), and text
already in the request's messages is never offered again.
"""

from __future__ import annotations

from collections.abc import Sequence

from memory.recall.outcome import Recalled
from memory.recall.ranking import Candidate
from memory.storage.fts import search_terms, text_words
from memory.storage.turns import NewTurn

# Spooled turns are keyed "c-<n>" (n from 1, in the order said): candidate_chunk reads them as
# chunk ids no stored chunk has (negative), so they order among themselves and have no
# stored neighbours.
_KEY = "c-{}"


class SpoolRecall(Exception):
    """Recall answered from the spool alone: the database is unreachable (the cause). The
    block is injected; the outage is still reported (X-Memory-Error)."""

    def __init__(self, recalled: Recalled) -> None:
        super().__init__("recalled from the local spool only: a backing service is unreachable")
        self.recalled = recalled


def spooled_candidates(
    turns: Sequence[NewTurn], query: str, present: str, session_id: str, *, scale: float = 1.0
) -> dict[str, Candidate]:
    """The spooled turns that share words with `query`, as lexical candidates.

    A turn's lexical score is the share of the query's words it holds, times `scale` (the
    best score of the stored turns' search, so both rank on one footing before fusion
    scales them together). Turns whose text is in the request already are left out.
    """
    terms = search_terms(query)
    if not terms:
        return {}
    found: dict[str, Candidate] = {}
    for n, turn in enumerate(turns, start=1):
        text = turn.content.strip()
        if not text or text in present:
            continue
        words = {_stem(w) for w in text_words(f"{text} {turn.name or ''}")}
        share = sum(_stem(term) in words for term in terms) / len(terms)
        if share > 0:
            key = _KEY.format(n)
            found[key] = Candidate(
                key, session_id, turn.created_at, turn.content, speaker=turn.name or turn.role,
                bm25=share * scale, role=turn.role,
            )
    return found


def _stem(word: str) -> str:
    # FTS stems its words (porter); a plural's "s" is the difference that matters most here.
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word
