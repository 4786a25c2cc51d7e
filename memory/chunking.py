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
from collections.abc import Callable, Iterator
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
_PROSE_LEVELS = (_PARAGRAPH, _SENTENCE, _WORD)
_CODE_LEVELS = (_WORD,)  # only for a single line that is over the cap on its own


@dataclass(frozen=True)
class Chunk:
    """One indexable piece of a turn."""

    ordinal: int
    kind: Kind
    text: str
    tokens: int


def chunk_text(text: str, *, max_tokens: int, count: Count) -> list[Chunk]:
    """Split `text` into chunks of at most `max_tokens` by `count`; [] for blank text."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if not text.strip():
        return []
    segments = list(_segments(text))
    whole = text.strip()
    if count(whole) <= max_tokens:
        kinds = {kind for kind, segment in segments if segment.strip()}
        return [Chunk(0, "code" if kinds == {"code"} else "prose", whole, count(whole))]
    pieces: list[tuple[Kind, str]] = []
    for kind, segment in segments:
        tidy = _tidy_code if kind == "code" else _tidy_prose
        levels = _CODE_LEVELS if kind == "code" else _PROSE_LEVELS
        units = _code_units(segment, max_tokens, count) if kind == "code" else [segment]
        fitted = [part for unit in units for part in _fit(unit, levels, max_tokens, count, tidy)]
        pieces.extend((kind, packed) for packed in _pack(fitted, max_tokens, count, tidy))
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


def _code_units(block: str, max_tokens: int, count: Count) -> list[str]:
    """Return a code block whole when it fits, else its lines."""
    if count(_tidy_code(block)) <= max_tokens:
        return [block]
    return block.splitlines(keepends=True)


def _fit(
    text: str, levels: tuple[re.Pattern[str], ...], max_tokens: int, count: Count, tidy: Tidy
) -> list[str]:
    """Split `text` at the coarsest boundaries needed so that every part fits the cap."""
    if count(tidy(text)) <= max_tokens:
        return [text]
    if not levels:
        return _split_characters(text, max_tokens, count, tidy)
    parts = _split_after(text, levels[0])
    if len(parts) == 1:
        return _fit(text, levels[1:], max_tokens, count, tidy)
    return [fitted for part in parts for fitted in _fit(part, levels, max_tokens, count, tidy)]


def _split_after(text: str, boundary: re.Pattern[str]) -> list[str]:
    """Cut `text` right after each match of `boundary`, keeping every character."""
    cuts = [0, *(m.end() for m in boundary.finditer(text) if 0 < m.end() < len(text)), len(text)]
    return [text[start:end] for start, end in pairwise(cuts) if start < end]


def _split_characters(text: str, max_tokens: int, count: Count, tidy: Tidy) -> list[str]:
    """Cut `text` into the longest prefixes that fit, for a word or line over the cap."""
    parts: list[str] = []
    rest = text
    while rest:
        size = _longest_fitting_prefix(rest, max_tokens, count, tidy)
        parts.append(rest[:size])
        rest = rest[size:]
    return parts


def _longest_fitting_prefix(text: str, max_tokens: int, count: Count, tidy: Tidy) -> int:
    """Binary-search the longest prefix within the cap; at least one character."""
    low, high = 1, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if count(tidy(text[:middle])) <= max_tokens:
            low = middle
        else:
            high = middle - 1
    # A single character over the cap (only possible with a cap of a few tokens) stands alone.
    return low


def _pack(units: list[str], max_tokens: int, count: Count, tidy: Tidy) -> list[str]:
    """Greedily join consecutive units while the joined text stays within the cap."""
    packed: list[str] = []
    current = ""
    for unit in units:
        candidate = current + unit
        # Counted as joined, not summed: BPE counts are not additive across boundaries.
        if count(tidy(candidate)) <= max_tokens:
            current = candidate
            continue
        if tidy(current):
            packed.append(tidy(current))
        current = unit
    if tidy(current):
        packed.append(tidy(current))
    return packed


def _tidy_prose(text: str) -> str:
    """Trim surrounding whitespace."""
    return text.strip()


def _tidy_code(text: str) -> str:
    """Drop leading blank lines and trailing whitespace, keeping the first line's indent."""
    return re.sub(r"^\s*\n", "", text).rstrip()
