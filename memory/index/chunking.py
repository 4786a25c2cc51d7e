"""Split a turn's text into code and prose chunks under a token cap, for indexing.

A text that fits the cap is one chunk. A longer one is cut into its fenced code blocks
(CommonMark fences: ``` or ~~~, optionally with an info string such as a language) and the
prose between them. Each piece over the cap is split at the coarsest boundary that works:
code on line boundaries; prose on paragraphs, then lines and sentences, then words; a single
word or line still over the cap is cut by characters. The pieces are then packed greedily.

Chunks only trim whitespace at their edges: joined together they hold every non-whitespace
character of the input, in order. Split code blocks are not re-fenced, for the same reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

Kind = Literal["code", "prose"]
Count = Callable[[str], int]
Tidy = Callable[[str], str]

_FENCE_OPEN = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_FENCE_CLOSE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})\s*$")
# Boundaries, coarsest first; a piece ends right after the match (its trailing whitespace).
_PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*\s+|[\u3002\uff01\uff1f]+\s*|\n\s*")
_WORD = re.compile(r"\s+")
# Every line break str.splitlines knows, so code splits into the lines it would give.
_LINE = re.compile(r"\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_PROSE_LEVELS = (_PARAGRAPH, _SENTENCE, _WORD)
_CODE_LEVELS = (_LINE, _WORD)  # words only for a single line that is over the cap on its own


@dataclass(frozen=True)
class Chunk:
    """One indexable piece of a turn."""

    ordinal: int
    kind: Kind
    text: str
    tokens: int


# Characters a token of ordinary text spans at most, to cut a text down before chunking it
# (about 4 in English prose; the bound may leave fewer than max_chunks, never more work).
CHARS_PER_TOKEN_BOUND = 8


def chunk_text(text: str, *, max_tokens: int, count: Count, max_chunks: int = 0) -> list[Chunk]:
    """Split `text` into chunks of at most `max_tokens` by `count`; [] for blank text.

    `max_chunks` (0: no limit) keeps the first chunks only, and chunks only the start of the
    text they can come from: a huge text costs what its first `max_chunks` chunks cost."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if max_chunks > 0:
        return chunk_text(
            text[: max_chunks * max_tokens * CHARS_PER_TOKEN_BOUND], max_tokens=max_tokens,
            count=count,
        )[:max_chunks]
    if not text.strip():
        return []
    segments = list(_segments(text))
    whole = text.strip()
    if count(whole) <= max_tokens:
        kinds = {kind for kind, segment in segments if segment.strip()}
        return [Chunk(0, "code" if kinds == {"code"} else "prose", whole, count(whole))]
    pieces: list[tuple[Kind, str]] = []
    for kind, segment in segments:
        tidy = _tidy_code if kind == "code" else str.strip
        levels = _CODE_LEVELS if kind == "code" else _PROSE_LEVELS
        fitted = _fit(segment, levels, max_tokens, count, tidy)
        packed = (tidy(run) for run in _runs(fitted, max_tokens, count, tidy))
        pieces.extend((kind, text) for text in packed if text)
    return [Chunk(i, kind, piece, count(piece)) for i, (kind, piece) in enumerate(pieces)]


def _segments(text: str) -> Iterator[tuple[Kind, str]]:
    """Yield consecutive prose and fenced-code segments that together are exactly `text`."""
    prose: list[str] = []
    lines = iter(text.splitlines(keepends=True))
    for line in lines:
        opening = _FENCE_OPEN.match(line.rstrip())
        if opening is None or (
            opening["fence"][0] == "`" and "`" in opening["info"]  # CommonMark: not a fence
        ):
            prose.append(line)
            continue
        if prose:
            yield "prose", "".join(prose)
            prose = []
        yield "code", line + "".join(_fenced_body(lines, opening["fence"]))
    if prose:
        yield "prose", "".join(prose)


def _fenced_body(lines: Iterator[str], fence: str) -> Iterator[str]:
    """Yield lines up to and including the closing fence (or to the end when unclosed)."""
    for line in lines:
        yield line
        closing = _FENCE_CLOSE.match(line.rstrip())
        if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence):
            return


def _fit(
    text: str, levels: tuple[re.Pattern[str], ...], max_tokens: int, count: Count, tidy: Tidy
) -> list[str]:
    """Split `text` at the coarsest boundaries needed so that every part fits the cap."""
    if count(tidy(text)) <= max_tokens:
        return [text]
    for depth, boundary in enumerate(levels):
        parts = _split_after(text, boundary)
        if len(parts) > 1:
            # A part ends at most at one boundary of this level, so only finer ones remain.
            finer = levels[depth + 1 :]
            return [piece for part in parts for piece in _fit(part, finer, max_tokens, count, tidy)]
    return list(_runs(text, max_tokens, count, tidy))


def _split_after(text: str, boundary: re.Pattern[str]) -> list[str]:
    """Cut `text` right after each match of `boundary`, keeping every character."""
    cuts = [0, *(m.end() for m in boundary.finditer(text) if 0 < m.end() < len(text)), len(text)]
    return [text[start:end] for start, end in pairwise(cuts) if start < end]


def _runs(units: Sequence[str], max_tokens: int, count: Count, tidy: Tidy) -> Iterator[str]:
    """Greedily join consecutive units (pieces, or the characters of a word or line over the
    cap) into the longest runs whose joined text stays within the cap, in order."""
    taken = 1
    while units:
        # Counted as joined, not summed: BPE counts are not additive across boundaries.
        taken = _furthest_fit(units, lambda joined: count(tidy(joined)) <= max_tokens, taken)
        yield "".join(units[:taken])
        units = units[taken:]


def _furthest_fit(units: Sequence[str], fits_text: Callable[[str], bool], hint: int) -> int:
    """Return n in 1..len(units) with fits(n) and not fits(n + 1), searching outward from
    `hint`, where fits(n) tells whether the first n units (characters or pieces), joined, fit.

    Consecutive chunks tend to take about as much as the previous one, so galloping from
    that hint costs a few counts per chunk instead of one count per unit, which would be
    quadratic on long texts of short words. Token counts only almost grow with length, so n
    may not be the very largest that fits. fits(1) is assumed: a lone unit or character over
    a cap of a few tokens has to stand alone.
    """
    def fits(n: int) -> bool:
        return fits_text(units[:n] if isinstance(units, str) else "".join(units[:n]))

    limit = len(units)
    hint = min(max(hint, 1), limit)
    low, high, step = 1, limit + 1, 1  # fits(low) holds; high is the first known misfit
    if hint == 1 or fits(hint):
        low = hint
        while low + step < high and fits(low + step):
            low, step = low + step, step * 2
        high = min(high, low + step)
    else:
        high = hint
        while hint - step > low and not fits(hint - step):
            high, step = hint - step, step * 2
        low = max(low, hint - step)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _tidy_code(text: str) -> str:
    """Drop leading blank lines and trailing whitespace, keeping the first line's indent."""
    return re.sub(r"^\s*\n", "", text).rstrip()
