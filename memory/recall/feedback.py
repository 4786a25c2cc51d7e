"""Lexical pseudo-relevance feedback: search again with the telling words of the first hits.

A question rarely uses all the words of its answer ("What recipes has Joanna made?" / "...
a chocolate raspberry tart ..."), but the best BM25 hits are usually about the right thing,
so the rare words they share are likely in other relevant turns too. This is RM3 (Lavrenko
and Croft's relevance model interpolated with the query; Abdul-Jaleel et al., TREC 2004):
a word weighs its share of each first hit's text, weighted by the hit's score, times its
rarity; the best few words are searched as a second query whose BM25 counts `weight` as
much as the question's own (BM25 is a sum over words, so the sum of the two searches is one
search whose expansion words are down-weighted).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memory.recall.lexical import ChunkSearch
from memory.storage import turns
from memory.storage.fts import search_terms
from memory.storage.turns import ChunkRow

# Words shorter than this say little ("yes", "fun") and are often just inflections.
MIN_WORD = 4
# Hits a word must be in: one hit's word is as likely its own topic as the question's.
MIN_HITS = 2
# Candidate words whose rarity is counted: the best this many times `terms` by share alone.
COUNTED_PER_TERM = 3
# How long the count of all chunks (the rarity's denominator) is reused.
TOTAL_TTL_SECONDS = 300.0
_LETTERS = re.compile(r"^[^\W\d_]+$")
_SUFFIXES = ("ings", "ing", "ies", "ied", "ers", "er", "ed", "es", "ly", "s")


@dataclass(frozen=True)
class Feedback:
    """How the second, expanded lexical search is made."""

    weight: float = 0.0  # 0: no second search
    docs: int = 10  # first hits whose words are weighed
    terms: int = 8  # words searched again


def root(word: str) -> str:
    """A crude stem, only to tell a query word's inflections from new words."""
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def word_shares(query_terms: Sequence[str], hits: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Each new word's relevance-model weight: its share of each hit's words, weighted by
    the hit's share of the hits' scores (RM1); query words and their inflections are left out."""
    total = sum(max(score, 0.0) for _, score in hits)
    if total <= 0:
        return {}
    asked = {root(t) for t in query_terms}
    shares: dict[str, float] = {}
    seen: dict[str, int] = {}
    for text, score in hits:
        words = search_terms(text)  # distinct words: a repeated word counts once per hit
        kept = [w for w in words if len(w) >= MIN_WORD and _LETTERS.match(w)]
        for word in kept:
            if root(word) not in asked:
                shares[word] = shares.get(word, 0.0) + max(score, 0.0) / total / len(words)
                seen[word] = seen.get(word, 0) + 1
    return {w: s for w, s in shares.items() if seen[w] >= MIN_HITS}


def expansion_terms(
    shares: Mapping[str, float], counts: Mapping[str, int], total: int, n: int
) -> list[str]:
    """The `n` words of best share times rarity (BM25's idf over `total` rows) that can find
    something new: a word only one row holds is the hit it came from."""
    scored = {
        w: s * math.log((total - counts[w] + 0.5) / (counts[w] + 0.5))
        for w, s in shares.items()
        if counts.get(w, 0) >= 2 and counts[w] < total / 2
    }
    return sorted((w for w in scored if scored[w] > 0), key=lambda w: (-scored[w], w))[:n]


def merge(
    first: Sequence[tuple[int, float]], second: Sequence[tuple[int, float]], weight: float
) -> list[tuple[int, float]]:
    """The two searches' hits with the second's scores added at `weight`, best first."""
    scores = dict(first)
    for key, score in second:
        scores[key] = scores.get(key, 0.0) + weight * score
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))


class LexicalFeedback:
    """The chunk search, then (when `feedback.weight`) a second one with the first hits'
    telling words, merged; returns the hits and their rows."""

    def __init__(self, search: ChunkSearch, feedback: Feedback) -> None:
        self.search = search
        self.feedback = feedback
        self._total: tuple[int, float] = (0, -math.inf)

    async def find(
        self, user_id: str, query: str, *, k: int, session_id: str | None = None
    ) -> tuple[list[tuple[int, float]], list[ChunkRow]]:
        """Best `k` (chunk_id, score) of each search merged, and their chunks."""
        found = await self.search.search(user_id, query, k=k, session_id=session_id)
        rows = await turns.get_chunks(self.search.db, [chunk_id for chunk_id, _ in found])
        words = await self.expand(query, found, rows)
        if not words:
            return found, rows
        again = await self.search.search(user_id, " ".join(words), k=k, session_id=session_id)
        merged = merge(found, again, self.feedback.weight)
        have = {row.id for row in rows}
        rows += await turns.get_chunks(self.search.db, [chunk_id for chunk_id, _ in again if chunk_id not in have])
        return merged, rows

    async def expand(
        self, query: str, found: Sequence[tuple[int, float]], rows: Sequence[ChunkRow]
    ) -> list[str]:
        """The words to search again for, from the first hits; none when feedback is off."""
        fb = self.feedback
        if fb.weight <= 0 or fb.terms <= 0 or not found:
            return []
        text = {row.id: row.text for row in rows}
        hits = [(text[i], score) for i, score in found[: fb.docs] if i in text]
        shares = word_shares(search_terms(query), hits)
        likely = sorted(shares, key=lambda w: (-shares[w], w))[: COUNTED_PER_TERM * fb.terms]
        if not likely:
            return []
        counts = await self.search.terms.counts(likely)
        return expansion_terms({w: shares[w] for w in likely}, counts, await self._all(), fb.terms)

    async def _all(self) -> int:
        count, at = self._total
        if time.monotonic() - at > TOTAL_TTL_SECONDS:
            self._total = (count := await turns.count_all_chunks(self.search.db), time.monotonic())
        return count
