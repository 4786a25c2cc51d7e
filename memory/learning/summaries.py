"""Session summaries: structured JSON plus readable text, rolled up per session.

Each new summary of a session covers the whole session so far (the previous one is given to
the summariser and rolled in), so the previous summary gets `superseded_by` and is kept as
history only; recall uses a session's current summary. The SQL is memory.storage.summaries'.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import KW_ONLY, dataclass

from memory.learning.facts import FactError, queue_sync
from memory.redact import keep
from memory.storage import summaries
from memory.storage.database import Database
from memory.storage.summaries import NewSummary, Summary

__all__ = ["SUMMARY_KEYS", "Summary", "SummaryStore", "summary_lock"]

SUMMARY_KEYS = ("facts", "preferences", "decisions", "todos", "entities")


def summary_lock(db: Database, user_id: str, session_id: str) -> AbstractAsyncContextManager[None]:
    """Held while a session's summary is read, extended and stored: one summarize job per
    session at a time on any replica (a database lock), so two jobs never roll up the same
    previous summary and the later one to commit never hides turns the other covered."""
    return db.hold(f"summary:{user_id}\n{session_id}")


@dataclass(eq=False)
class SummaryStore:
    """Summaries of every user, always read and written scoped to one user."""

    db: Database
    _: KW_ONLY
    redact: Callable[[str], str] = keep
    notify: Callable[[], None] = lambda: None

    async def list(
        self, user_id: str, session_id: str | None = None, *, include_history: bool = False
    ) -> builtins.list[Summary]:
        """This user's summaries (current ones unless asked), newest first."""
        return await summaries.of_user(self.db, user_id, session_id, history=include_history)

    async def get(self, user_id: str, summary_id: int) -> Summary | None:
        """One of this user's summaries, or None."""
        return await summaries.get(self.db, user_id, summary_id)

    async def get_many(self, user_id: str, ids: Sequence[int]) -> builtins.list[Summary]:
        """These summaries of this user, in the order asked; unknown ids are skipped."""
        found = {s.id: s for s in await summaries.get_many(self.db, user_id, ids)}
        return [found[i] for i in ids if i in found]

    async def latest(self, user_id: str, session_id: str) -> Summary | None:
        """The session's current summary, or None."""
        found = await self.list(user_id, session_id)
        return found[0] if found else None

    async def put(
        self,
        user_id: str,
        session_id: str,
        text: str,
        data: Mapping[str, Sequence[str]],
        *,
        source_turn_ids: Sequence[int],
        last_turn_id: int,
        user_turns: int,
        tokens: int,
    ) -> Summary:
        """Store the session's new current summary; the previous one becomes history."""
        if not text.strip():
            raise FactError("a summary needs text", "text")
        text = self.redact(text)
        clean = {key: [self.redact(str(v)) for v in data.get(key, ())] for key in SUMMARY_KEYS}
        async with self.db.write() as tx:
            new_id = await summaries.insert(tx, NewSummary(
                user_id, session_id, text.strip(), clean, source_turn_ids=source_turn_ids,
                last_turn_id=last_turn_id, user_turns=user_turns, tokens=tokens,
                created_at=time.time(),
            ))
            old = await summaries.supersede_others(tx, user_id, session_id, new_id)
            await queue_sync(tx, summaries=[new_id, *old])
        self.notify()
        summary = await self.get(user_id, new_id)
        assert summary is not None
        return summary

    async def delete(self, user_id: str, summary_id: int) -> bool:
        """Delete one summary (vectors follow by job)."""
        async with self.db.write() as tx:
            deleted = await summaries.delete(tx, user_id, summary_id=summary_id)
            await queue_sync(tx, summaries=deleted)
        self.notify()
        return bool(deleted)

    async def search(
        self, user_id: str, query: str, *, k: int, session_id: str | None = None
    ) -> builtins.list[tuple[int, float]]:
        """Best `k` (summary_id, bm25) among current summaries in scope, best first."""
        return await summaries.search(self.db, user_id, query, k=k, session_id=session_id)
