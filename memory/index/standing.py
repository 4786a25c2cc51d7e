"""Standing statements: what a user says once and means from then on.

"Always use APA 7th edition when I ask about references", "Never suggest jQuery", "I prefer
Microsoft Word over Google Docs": a user states an instruction or a preference once, and
every later question on its subject should be answered with it in mind, however many turns
have passed and however few of the question's words it shares. In a long conversation on one
subject, a one-line instruction ranks far below the hundreds of turns that discuss the
subject itself. So indexing flags a chunk of the user's own turn (role user, no name) that
states one, and recall searches the flagged chunks on their own and lifts those that are
about the question (docs/memory.md, "Standing statements").

The shapes are English's usual ways of stating one: a sentence that opens with "always" or
"never" (after an optional "please"), "from now on", and "I prefer" ("I'd prefer", "I would
prefer"). Chat between named people is left alone, as for the user's own turns in ranking.
"""

from __future__ import annotations

import re

# Vector metadata key of a flagged chunk (value True; absent on every other chunk).
STANDING = "standing"
_STATEMENT = re.compile(
    r"(?:^|[.!?]\s+|\n)\s*(?:please\s+)?(?:always|never)\b"
    r"|\bfrom now on\b"
    r"|\bI(?:\s+would|'d|’d)?\s+prefer\b",
    re.IGNORECASE,
)


def is_standing(text: str) -> bool:
    """Whether `text` states a standing instruction or preference (see the module docstring)."""
    return _STATEMENT.search(text) is not None
