"""Showing long turns by the part that matches, and the same text once.

A step of recall between ranking and packing (docs/memory.md, "Excerpts"). Items are chunks
of up to chunk_max_tokens; in a working conversation most of them are parts of long
assistant replies, and shown whole, eight of them fill a 1,000-token block. So an item longer
than the cap is shown as an excerpt: the run of its sentences (lines, in code) that holds the
most of the query's words, rarer words counting more, within the cap, marked as cut where it
was. A neighbour lifted only for context (it matched nothing itself) gets half the cap, from
its start: a short question that matches should not bring in the first screen of the long
reply after it. A reply of the model gets half of that again (REPLY_SHARE), so the block holds
more items. Short items, as in chat between people, are shown whole.

Then near-duplicates go: an item whose long lines are mostly in an item ranked above it (the
user's code, then the assistant's copy of it) is dropped, so the budget holds it once.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from memory.recall.ranking import Candidate

# Characters a token of prose spans, about: the cap is applied in characters, since counting
# tokens of every sentence of every candidate would cost recall milliseconds. Packing counts
# the block's tokens exactly afterwards.
CHARS_PER_TOKEN = 4
# How many of the ranked items are excerpted and compared; packing a 2,000-token block
# seldom reaches further, and the rest are left as they are.
EXCERPTED = 48
# A single sentence (line) is shown whole up to this many times the cap, and cut at a word
# beyond: a sentence cut short loses what it says, and sentences of working conversations
# ("I'm trying to ... , can you help me ...") often run past the cap.
WHOLE_UNIT = 2
# A neighbour that matched nothing itself gets this share of the cap.
CONTEXT_SHARE = 0.5
# A reply of the model (role assistant, no name) gets this share of the cap: it elaborates on
# what the user said, and the sentence that matches is what a later question needs of it;
# the user's own turns, which state the facts, get the whole cap.
REPLY_SHARE = 0.5
MODEL = "assistant"
# Lines at least this long (whitespace squashed) are compared to find near-duplicates, and
# an item whose such lines are at least this share already shown is dropped.
DUPLICATE_LINE_CHARS = 24
DUPLICATE_SHARE = 0.67
# Between two units: the spaces after . ! ? (and a closing quote or bracket), or a line break
# with the spaces around it. Each alternative opens with a character class, which the regex
# engine scans for fast.
_UNIT_END = re.compile(r"(?P<end>[.!?][\"')\]]*)\s+|[ \t]*\n\s*")
_SUFFIXES = ("ing", "ed", "es", "s", "ly")


def stem(word: str) -> str:
    """A crude stem, so `sprint` finds `sprints` and `end` finds `ended`."""
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


@dataclass(frozen=True)
class Terms:
    """The query's words as excerpts look for them: stem -> weight, and a pattern that finds
    any of them (with a common suffix) in one pass in C."""

    weights: Mapping[str, float]
    pattern: re.Pattern[str] | None


def query_terms(counts: Mapping[str, int]) -> Terms:
    """Each query word's stem and its weight: rarer words (fewer chunks hold them) weigh
    more, as in BM25."""
    weights: dict[str, float] = {}
    for term, count in counts.items():
        key = stem(term)
        weights[key] = max(weights.get(key, 0.0), 1.0 / math.log2(2 + count))
    if not weights:
        return Terms({}, None)
    stems = "|".join(map(re.escape, sorted(weights, key=len, reverse=True)))
    suffixes = "|".join(_SUFFIXES)
    return Terms(weights, re.compile(rf"\b({stems})(?:{suffixes})?\b", re.IGNORECASE))


def excerpt_ranked(
    ranked: Sequence[Candidate], terms: Terms, cap_tokens: int
) -> list[Candidate]:
    """The ranking with its first EXCERPTED items excerpted and near-duplicates dropped
    (see the module docstring); `cap_tokens` 0 leaves it as it is."""
    if cap_tokens <= 0:
        return list(ranked)
    cap = cap_tokens * CHARS_PER_TOKEN
    out: list[Candidate] = []
    seen: set[str] = set()
    for index, candidate in enumerate(ranked):
        if index >= EXCERPTED:
            out.append(candidate)
            continue
        shown = excerpt(candidate, terms, cap)
        lines = _long_lines(shown.text)
        if lines and sum(line in seen for line in lines) >= DUPLICATE_SHARE * len(lines):
            continue
        seen.update(lines)
        out.append(shown)
    return out


def excerpt(candidate: Candidate, terms: Terms, cap: int) -> Candidate:
    """`candidate` with its text cut to the best run of units within `cap` characters."""
    text = candidate.text.strip()
    matched = candidate.dense > 0 or candidate.bm25 > 0
    limit = cap if matched else int(cap * CONTEXT_SHARE)
    if candidate.role == candidate.speaker == MODEL:
        limit = int(limit * REPLY_SHARE)
    if len(text) <= limit:
        return candidate
    hits = list(terms.pattern.finditer(text)) if matched and terms.pattern else []
    if hits:
        spans = _units(text)
        first, last = _best_run(spans, _found(spans, hits), terms.weights, limit)
    else:  # the units from the start that fit: only the start needs splitting
        spans = _units(text[: WHOLE_UNIT * limit + 1])
        first, last = _best_run(spans, [frozenset()] * len(spans), terms.weights, limit)
    start, end = spans[first][0], spans[last][1]
    if end - start > WHOLE_UNIT * limit:  # a unit too long to show whole: its start, at a word
        cut = text.rfind(" ", start, start + limit)
        end = cut if cut > start else start + limit
    body = text[start:end].strip()
    return replace(candidate, text=body, cut=(start > 0, end < len(text)))


def _units(text: str) -> list[tuple[int, int]]:
    """(start, end) of the text's sentences and lines, in order, without the spaces between."""
    spans, start = [], 0
    for match in _UNIT_END.finditer(text):
        end = match.start() + len(match["end"] or "")
        if end > start:
            spans.append((start, end))
        start = match.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans or [(0, len(text))]


def _found(spans: Sequence[tuple[int, int]], hits: Sequence[re.Match[str]]
           ) -> list[frozenset[str]]:
    """The query's words (stems) each unit holds."""
    found: list[set[str]] = [set() for _ in spans]
    starts = [a for a, _ in spans]
    for hit in hits:
        found[bisect_right(starts, hit.start()) - 1].add(hit[1].lower())
    return [frozenset(f) for f in found]


def _best_run(spans: Sequence[tuple[int, int]], found: Sequence[frozenset[str]],
              weights: Mapping[str, float], limit: int) -> tuple[int, int]:
    """The first and last unit to show: the run within `limit` characters whose distinct
    query words weigh most (the shortest, then the earliest, of equals), then the units
    after it while the run stays within half the limit, so a one-line match keeps a little
    of what follows. With no word found, the units from the start that fit."""
    best, best_score = (0, 0), 0.0
    for first in range(len(spans)):
        if not found[first]:
            continue  # a best run starts with a unit that holds a word
        words: set[str] = set()
        for last in range(first, len(spans)):
            if last > first and spans[last][1] - spans[first][0] > limit:
                break
            if found[last] - words:
                words |= found[last]
                score = sum(weights.get(w, 0.0) for w in words)
                shorter = spans[last][1] - spans[first][0] < spans[best[1]][1] - spans[best[0]][0]
                if score > best_score + 1e-9 or (score > best_score - 1e-9 and shorter):
                    best, best_score = (first, last), score
    start, end = best
    reach = limit if best_score == 0 else limit // 2
    while end + 1 < len(spans) and spans[end + 1][1] - spans[start][0] <= reach:
        end += 1
    return start, end


def _long_lines(text: str) -> set[str]:
    return {s for line in text.splitlines() if len(s := " ".join(line.split())) >= DUPLICATE_LINE_CHARS}



def one_per_turn(ranked: Sequence[Candidate]) -> list[Candidate]:
    """The ranking with each turn's best chunk first and its other chunks after every
    turn's best (in rank order otherwise). A long reply is indexed as many chunks, which
    match the same question together and would fill the block with one turn; the next turn
    is worth more than a turn's second chunk."""
    seen: set[int] = set()
    first: list[Candidate] = []
    later: list[Candidate] = []
    for candidate in ranked:
        (later if candidate.turn_id in seen else first).append(candidate)
        seen.add(candidate.turn_id)
    return first + later
