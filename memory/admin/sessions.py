"""Sessions of one user: listed by last activity with counts, read turn by turn, deleted."""

from __future__ import annotations

import builtins
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from memory.admin.forget import forget_session
from memory.storage import facts, sessions, summaries, turns
from memory.storage.database import Database
from memory.storage.turns import Turn

MAX_PAGE = 500
TITLE_CHARS = 120
CURSOR = re.compile(r"[0-9]{1,20}(\.[0-9]{1,20})?(e[+-]?[0-9]{1,3})?:(?:[0-9a-f]{2}){0,1024}")


class CursorError(ValueError):
    """A pagination cursor that this listing did not hand out."""


@dataclass(frozen=True)
class SessionInfo:
    """A session with its counts; `title` is the start of its first user message."""

    session_id: str
    created_at: float
    last_active: float
    turns: int
    facts: int
    summaries: int
    title: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return asdict(self)


class SessionStore:
    """Reads and deletes one user's sessions."""

    def __init__(self, db: Database, *, notify: Callable[[], None]) -> None:
        self.db = db
        self.notify = notify

    async def list(
        self, user_id: str, *, limit: int = 50, cursor: str | None = None
    ) -> tuple[builtins.list[SessionInfo], str | None]:
        """A page of sessions, most recently active first, and the next page's cursor."""
        before = None if cursor is None else _decode(cursor)
        rows = await sessions.page(self.db, user_id, limit=limit + 1, before=before)
        found = await self._infos(user_id, rows[:limit])
        more = len(rows) > limit
        return found, _encode(found[-1].last_active, found[-1].session_id) if more else None

    async def get(self, user_id: str, session_id: str) -> SessionInfo | None:
        """One session with its counts, or None."""
        row = await sessions.get(self.db, user_id, session_id)
        return None if row is None else (await self._infos(user_id, [row]))[0]

    async def turns(
        self, user_id: str, session_id: str, *, limit: int = 100, after: int = 0
    ) -> tuple[builtins.list[Turn], int | None]:
        """A page of the session's turns in the order they were stored, and the next `after`."""
        found = await turns.session_page_ids(
            self.db, user_id, session_id, after=after, limit=limit + 1
        )
        ids = found[:limit]
        return await turns.get_many(self.db, ids), ids[-1] if len(found) > limit else None

    async def delete(self, user_id: str, session_id: str) -> dict[str, int] | None:
        """Forget the session (see memory.admin.forget.forget_session); None when unknown."""
        async with self.db.write() as tx:
            removed = await forget_session(tx, user_id, session_id)
        if removed is not None:
            self.notify()
        return removed

    async def _infos(
        self, user_id: str, rows: Sequence[tuple[str, float, float]]
    ) -> builtins.list[SessionInfo]:
        """The listed sessions with their counts: turns, current facts learned in each
        session, current summaries, and the title."""
        ids = [row[0] for row in rows]
        turn_counts = await turns.count_by_session(self.db, user_id, ids)
        fact_counts = await facts.count_by_session(self.db, user_id, ids)
        summary_counts = await summaries.count_by_session(self.db, user_id, ids)
        titles = await turns.titles(self.db, user_id, ids, TITLE_CHARS)
        return [
            SessionInfo(
                session_id, created_at, last_active, turn_counts.get(session_id, 0),
                fact_counts.get(session_id, 0), summary_counts.get(session_id, 0),
                titles.get(session_id, ""),
            )
            for session_id, created_at, last_active in rows
        ]


_SHOWN = tuple(
    f.name for f in fields(Turn) if f.name not in {"user_id", "content_hash", "request_id"}
)


def turn_dict(turn: Turn) -> dict[str, Any]:
    """A turn as the API shows it (no user id, no content hash)."""
    return {name: getattr(turn, name) for name in _SHOWN}


def _encode(last_active: float, session_id: str) -> str:
    # `<last_active>:<session id as hex>`: every string of this shape is a valid cursor.
    return f"{last_active!r}:{session_id.encode().hex()}"


def _decode(cursor: str) -> tuple[float, str]:
    if not CURSOR.fullmatch(cursor):
        raise CursorError("invalid cursor")
    time_text, _, hex_id = cursor.partition(":")
    return float(time_text), bytes.fromhex(hex_id).decode("utf-8", "replace")
