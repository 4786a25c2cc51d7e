"""The recall query's vector, with the names of the people in the user's memory set apart.

Every turn is embedded with its speaker's name in front ("Caroline: I went to a support
group yesterday"), so in a short question that names someone ("When did Caroline go to the
support group?") the name pulls the query towards everything that person said, whatever it
was about. The query is embedded without the names of the memory's speakers, and each name
it said is added back at a small weight (its own vector, kept): the topic leads, the person
still counts. On LoCoMo's dev conversations this raised evidence recall in a 1,000-token
block on all five conversations. Queries that name nobody, and memories whose turns carry
no names (only roles), embed exactly as before.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from memory.log.messages import TURN_ROLES
from memory.storage import turns
from memory.storage.database import Database

# How long a user's speaker names are reused, and for how many users.
NAMES_TTL_SECONDS = 300.0
MAX_USERS = 10_000
MAX_NAME_VECTORS = 10_000

_WORD = re.compile(r"[^\W_]")
_WORDS = re.compile(r"\w+")

Embed = Callable[[Sequence[str]], Awaitable[np.ndarray]]


def named(text: str, names: Sequence[str]) -> list[str]:
    """The names a text says, each as a whole word in any case, in the order given."""
    # Only names whose first word the text holds are matched in full: a memory with
    # thousands of speakers costs a set lookup per name, not a regular expression.
    words = set(_WORDS.findall(text.lower()))
    return [name for name in names
            if ((first := _WORDS.search(name.lower())) is None or first.group() in words)
            and _pattern(name).search(text)]


def without(text: str, names: Sequence[str]) -> str:
    """The text with these names (and a possessive 's after them) taken out."""
    for name in sorted(names, key=len, reverse=True):  # "Ana Lopez" before "Ana"
        text = _pattern(name).sub(" ", text)
    return " ".join(text.split())


def combine(query: np.ndarray, names: Sequence[np.ndarray], weight: float) -> np.ndarray:
    """The query's vector plus `weight` of each name's, as a unit vector."""
    total = query + weight * np.sum(names, axis=0) if names else query
    norm = float(np.linalg.norm(total))
    return total / norm if norm > 0 else query


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<!\w){re.escape(name)}(?:'s|’s)?(?!\w)", re.IGNORECASE)


class SpeakerQuery:
    """Embeds recall queries with the user's speakers' names set apart (module docstring)."""

    def __init__(self, db: Database, embed: Embed, *, weight: float, enabled: bool = True) -> None:
        self.db = db
        self._embed = embed
        self.weight = weight
        self.enabled = enabled
        self._names: dict[str, tuple[list[str], float]] = {}
        self._vectors: dict[str, np.ndarray] = {}

    async def embed(self, user_id: str, text: str) -> np.ndarray:
        """The query's vector (one row), names set apart when it says any."""
        said = named(text, await self.names(user_id)) if self.enabled else []
        rest = without(text, said)
        if not said or not _WORD.search(rest):  # only names (and punctuation): as written
            return await self._embed([text])
        new = [name for name in said if name not in self._vectors]
        vectors = await self._embed([rest, *new])
        if len(self._vectors) + len(new) > MAX_NAME_VECTORS:
            self._vectors.clear()
        self._vectors.update(zip(new, vectors[1:], strict=True))
        return combine(vectors[0], [self._vectors[name] for name in said], self.weight)[None, :]

    async def names(self, user_id: str) -> list[str]:
        """The names the user's turns were said under (not roles), kept NAMES_TTL_SECONDS."""
        now = time.monotonic()
        kept = self._names.get(user_id)
        if kept is not None and now - kept[1] < NAMES_TTL_SECONDS:
            return kept[0]
        found = [n for n in await turns.speaker_names(self.db, user_id) if n.lower() not in TURN_ROLES]
        if len(self._names) >= MAX_USERS:
            self._names.clear()
        self._names[user_id] = (found, now)
        return found
