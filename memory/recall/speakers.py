"""Lifting what the person a question names said.

A question about someone is mostly answered by what that person said: on LoCoMo's dev
conversations, 930 of the 967 evidence turns of questions that name one of the two speakers
were said by the one named, against 61 % of the other turns recall showed for them. The
lexical search matches the speaker's name too, but a name is in half the turns, so its BM25
weight is small. Only names count (a role word such as "user" says nothing about who is
meant), and a question naming every speaker lifts everyone alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from memory.log.messages import TURN_ROLES
from memory.recall.ranking import Candidate

_WORD = re.compile(r"[^\W_]+")


def named_in(query: str, speaker: str) -> bool:
    """Whether the query says the speaker's name (any word of it, whole, any case)."""
    said = set(_WORD.findall(query.lower()))
    return speaker not in TURN_ROLES and any(
        len(part) >= 2 and part in said for part in _WORD.findall(speaker.lower())
    )


def add_speaker(ranked: Sequence[Candidate], query: str, weight: float) -> list[Candidate]:
    """Add `weight` to the items whose speaker the query names, and re-rank."""
    named: dict[str, bool] = {}
    for c in ranked:
        if c.speaker not in named:
            named[c.speaker] = named_in(query, c.speaker)
        if named[c.speaker]:
            c.signals["speaker"] = 1.0
            c.score = round(c.score + weight, 6)
    return sorted(ranked, key=lambda c: (-c.score, -c.created_at, c.key))
