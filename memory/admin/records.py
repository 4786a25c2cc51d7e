"""One user's memory as JSON records: what export writes, import reads and clear-all keeps.

    {"type": "meta", "format": "memproxy-export", "version": 1, "user_id", "exported_at", "counts"}
    {"type": "turn", "id", "session_id", "parent_id", "role", "name", "content", "created_at", ...}
    {"type": "fact", "id", "text", "category", "confidence", ..., "previous_id", "superseded_by"}
    {"type": "summary", "id", "session_id", "text", "data", "source_turn_ids", ...}
    {"type": "profile", "consent", "profile": {"fields", "text", ...} | null}

Ids are the exporting database's; import maps them to new ones (parents, fact versions and
source turns keep pointing at the right rows). Records come in id order, parents first.

Text is redacted again on the way out (docs/security.md, secrets in stored text): a row
stored before a shape was known, or under `MEMPROXY_REDACT=off`, leaves redacted by the
mode the process runs with now.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any

from memory.learning.facts import FactStore
from memory.learning.profiles import ProfileStore
from memory.learning.summaries import SummaryStore
from memory.redact import keep, redact_profile, redact_record
from memory.storage import facts, turns
from memory.storage.database import Database
from memory.storage.facts import Fact
from memory.storage.summaries import Summary
from memory.storage.turns import Turn

FORMAT = "memproxy-export"
VERSION = 1
PAGE = 1000

TURN_FIELDS = tuple(
    f.name for f in fields(Turn) if f.name not in {"user_id", "position", "content_hash"}
)
_FACT_SKIP = frozenset({"user_id", "active"})


def fact_record(fact: Fact) -> dict[str, Any]:
    """One version of a fact as a record."""
    return {"type": "fact", **{k: v for k, v in fact.as_dict().items() if k not in _FACT_SKIP}}


def summary_record(summary: Summary) -> dict[str, Any]:
    """One summary as a record."""
    return {"type": "summary", **{k: v for k, v in summary.as_dict().items() if k != "user_id"}}


@dataclass(eq=False)
class RecordSource:
    """Reads one user's memory as records, page by page."""

    db: Database
    facts: FactStore
    summaries: SummaryStore
    profiles: ProfileStore
    _: KW_ONLY
    redact: Callable[[str], str] = keep

    async def counts(self, user_id: str) -> dict[str, int]:
        """How many records of each type the user's export holds."""
        return {
            "turn": await turns.count(self.db, user_id),
            "fact": await self.facts.count(user_id, active_only=False),
            "summary": len(await self.summaries.list(user_id, include_history=True)),
            "profile": int(await self.profile_record(user_id) is not None),
        }

    async def records(self, user_id: str, *, meta: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Every record of the user: meta (optional), turns, facts, summaries, profile."""
        if meta:
            yield {
                "type": "meta", "format": FORMAT, "version": VERSION, "user_id": user_id,
                "exported_at": time.time(), "counts": await self.counts(user_id),
            }
        async for turn in self.turns(user_id):
            yield {**turn, "content": self.redact(turn["content"])}
        for fact in await self.fact_records(user_id):
            yield redact_record(fact, self.redact)
        for summary in await self.summary_records(user_id):
            yield redact_record(summary, self.redact)
        profile = await self.profile_record(user_id)
        if profile is not None and profile["profile"] is not None:
            profile = {**profile, "profile": redact_profile(profile["profile"], self.redact)}
        if profile is not None:
            yield profile

    async def turns(self, user_id: str) -> AsyncIterator[dict[str, Any]]:
        """The user's turns in id order (a parent always before its children)."""
        after = 0
        while True:
            found = await turns.page(self.db, user_id, after=after, limit=PAGE)
            for turn in found:
                yield {"type": "turn", **{name: getattr(turn, name) for name in TURN_FIELDS}}
            if len(found) < PAGE:
                return
            after = found[-1].id

    async def fact_records(self, user_id: str) -> list[dict[str, Any]]:
        """Every version of every fact, oldest first."""
        # One read with no page limit: the whole list is held here anyway, to be sorted.
        found = await facts.page(self.db, user_id, limit=sys.maxsize)
        return [fact_record(f) for f in sorted(found, key=lambda f: f.id)]

    async def summary_records(self, user_id: str) -> list[dict[str, Any]]:
        """Every summary, history included, oldest first."""
        found = await self.summaries.list(user_id, include_history=True)
        return [summary_record(s) for s in sorted(found, key=lambda s: s.id)]

    async def profile_record(self, user_id: str) -> dict[str, Any] | None:
        """Consent and the profile, or None when the user never set either."""
        consent = await self.profiles.consent(user_id)
        profile = await self.profiles.get(user_id)
        if not consent and profile is None:
            return None
        body = None
        if profile is not None:
            body = {k: v for k, v in profile.as_dict().items() if k != "user_id"}
        return {"type": "profile", "consent": consent, "profile": body}
