"""The rules that decide what a newly extracted fact does to the facts already known.

For a new fact and the user's nearest active facts (cosine similarity of their vectors):

1. **Update by the model**: `updates_previous` names an active fact of this user -> the new
   fact supersedes it. `true` means "the closest fact of the same category" (similarity at
   least SUBJECT_SIMILARITY).
2. **Same subject, different value**: a fact of the same category, similarity at least
   SUBJECT_SIMILARITY, whose text shares with the new one a leading run of at least three
   words that ends in a single-valued predicate ("User lives in" Berlin / Paris, "User's
   favourite editor is" Vim / Emacs), and whose values after that run differ (neither is
   the start of the other) -> supersede. Multi-valued verbs ("likes", "uses", "has") never
   trigger this: "User likes tea" and "User likes coffee" are both kept.
3. **Duplicate**: similarity at or above the merge threshold -> merge (mentions + 1,
   confidence + MERGE_CONFIDENCE_STEP up to 1, last seen now).
4. Otherwise the fact is new.

A fact must also be grounded in what the user wrote: it must share more content words (by a
five-letter stem) with the user's messages of the excerpt than with the assistant's messages
alone. "Your server runs Debian 12", said by the assistant to a user who only asked about
"my server", never becomes "User's server runs Debian 12"; the assistant greeting the user
by name does not make "Ada moved to Lisbon" the assistant's fact.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SUBJECT_SIMILARITY = 0.5
MERGE_CONFIDENCE_STEP = 0.15
MIN_SHARED_WORDS = 3
SINGLE_VALUED = (
    ("is",), ("are",), ("was",), ("lives", "in"), ("lives", "at"), ("works", "at"),
    ("works", "as"), ("works", "for"), ("moved", "to"), ("is", "called"), ("is", "named"),
    ("is", "based", "in"), ("prefers",),
)
_WORD = re.compile(r"[\w'.+#-]+", re.UNICODE)
_STOP = frozenset(
    "the a an and or of to in on at for with by from is are was were be been has have had "
    "user user's users their they them this that it its as not no do does did will would "
    "can could should about into over than then also very".split()
)


@dataclass(frozen=True)
class Neighbour:
    """An active fact near the new one."""

    id: int
    text: str
    category: str
    similarity: float


@dataclass(frozen=True)
class Decision:
    """What to do with a new fact: `add`, `merge` into `target` or `supersede` `target`."""

    action: str
    target: int | None = None


def decide(
    text: str,
    category: str,
    updates_previous: int | bool | None,
    neighbours: Sequence[Neighbour],
    merge_similarity: float,
) -> Decision:
    """Apply the rules of this module, in order."""
    if isinstance(updates_previous, int) and not isinstance(updates_previous, bool):
        if any(n.id == updates_previous for n in neighbours):
            return Decision("supersede", updates_previous)
    same = [n for n in neighbours if n.category == category and n.similarity >= SUBJECT_SIMILARITY]
    if updates_previous is True and same:
        return Decision("supersede", max(same, key=lambda n: n.similarity).id)
    for n in sorted(same, key=lambda n: -n.similarity):
        if same_subject_new_value(n.text, text):
            return Decision("supersede", n.id)
    best = max(neighbours, key=lambda n: n.similarity, default=None)
    if best is not None and best.similarity >= merge_similarity:
        return Decision("merge", best.id)
    return Decision("add")


def same_subject_new_value(old: str, new: str) -> bool:
    """Rule 2: a shared leading run ending in a single-valued predicate, different values."""
    a, b = words(old), words(new)
    pairs = enumerate(zip(a, b, strict=False))  # stops at the shorter one
    shared = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
    if shared < MIN_SHARED_WORDS or shared == len(a) or shared == len(b):
        return False  # too little in common, or one is the other plus detail
    head = tuple(a[:shared])
    return any(head[-len(p):] == p for p in SINGLE_VALUED)


def words(text: str) -> list[str]:
    """Lower-cased words, trailing punctuation dropped."""
    return [w.strip(".,;:!?\"'").lower() for w in _WORD.findall(text) if w.strip(".,;:!?\"'")]


def stems(text: str) -> set[str]:
    """Content-word stems (first five letters) of a text."""
    return {w[:5] for w in words(text) if len(w) >= 3 and w not in _STOP}


def grounded_in(fact: str, user_texts: Iterable[str], assistant_texts: Iterable[str]) -> bool:
    """Whether the fact rests on the user's words: it shares content words with them, more
    than it shares with the assistant's messages alone."""
    mine = stems(fact)
    said = set().union(*map(stems, user_texts))
    only_assistant = set().union(*map(stems, assistant_texts)) - said
    return len(mine & said) > len(mine & only_assistant)
