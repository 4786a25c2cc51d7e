"""Which of a query's words the lexical search should use.

FTS5 scores every chunk that matches any query word, about 11 µs per matching row here, so a
query with a common word (a speaker's name, "project") on a user with 100k chunks ranks tens
of thousands of rows. The rare words carry the ranking anyway (BM25 weighs a word by how rare
it is), so the search keeps the rarest words and drops the commonest once the rows they would
match pass a budget. Word counts come from FTS5 itself and are kept for a few minutes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from memory.storage import turns
from memory.storage.database import Database
from memory.storage.fts import search_terms

# Rows the kept words may match in total; the rarest word is kept regardless.
MATCH_ROW_BUDGET = 2000
MIN_TERMS = 1
# How long a word's count is reused, and how many counts are kept.
COUNT_TTL_SECONDS = 300.0
MAX_COUNTS = 50_000

# How many rows (of every user) each word matches, in the order given.
Count = Callable[[Sequence[str]], Awaitable[Sequence[int]]]


class TermSelector:
    """Keeps a query's rarest words within `budget` matching rows, from cached counts."""

    def __init__(self, count: Count, *, budget: int = MATCH_ROW_BUDGET) -> None:
        self._count = count
        self._budget = budget
        self._counts: dict[str, tuple[int, float]] = {}

    async def select(self, terms: Sequence[str]) -> list[str]:
        """`terms` in their original order, without the commonest ones past the budget."""
        if len(terms) <= MIN_TERMS:
            return list(terms)
        counts = await self.counts(terms)
        kept: set[str] = set()
        rows = 0
        # A word no row holds cannot match: it neither counts as the rarest nor stays.
        for term in sorted((t for t in terms if counts[t]), key=lambda t: counts[t]):
            if len(kept) >= MIN_TERMS and rows + counts[term] > self._budget:
                break
            kept.add(term)
            rows += counts[term]
        return [t for t in terms if t in kept]

    async def counts(self, terms: Sequence[str]) -> dict[str, int]:
        """How many rows match each term (all owners); non-zero counts are kept for
        COUNT_TTL_SECONDS."""
        now = time.monotonic()
        fresh = {t: c for t in terms if (c := self._counts.get(t)) and now - c[1] < COUNT_TTL_SECONDS}
        missing = [t for t in terms if t not in fresh]
        if missing:
            row = await self._count(missing)
            if len(self._counts) + len(missing) > MAX_COUNTS:
                self._counts.clear()
            for term, n in zip(missing, row, strict=True):
                fresh[term] = (int(n), now)
                if n:  # a word nobody has said yet may be said any moment: count it again
                    self._counts[term] = (int(n), now)
        return {t: fresh[t][0] for t in terms}


class ChunkSearch:
    """BM25 search over turn chunks, scoped to a user (and a session), rare words first."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.terms = TermSelector(lambda words: turns.chunk_term_counts(db, words))

    async def search(
        self, user_id: str, query: str, *, k: int, session_id: str | None = None
    ) -> list[tuple[int, float]]:
        """Best `k` (chunk_id, score) for free text within the user's chunks, best first.

        The words match a chunk's text or its speaker's name; the commonest are dropped when
        the rows they match pass a budget (TermSelector).
        """
        if k <= 0:
            return []
        terms = await self.terms.select(search_terms(query))
        if not terms:
            return []
        return await turns.search_chunks(self.db, user_id, terms, k=k, session_id=session_id)
