"""Sessions of one user: listed by last activity with counts, read turn by turn, deleted."""

from __future__ import annotations

import builtins
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from memory.admin.forget import forget_session
from memory.storage.store import Store, Turn

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


_SELECT = (
    "SELECT s.session_id, s.created_at, s.last_active,"
    " (SELECT COUNT(*) FROM turns AS t WHERE t.user_id = s.user_id"
    "  AND t.session_id = s.session_id),"
    " (SELECT COUNT(*) FROM facts AS f WHERE f.user_id = s.user_id"
    "  AND f.source_session = s.session_id AND f.valid_to IS NULL),"
    " (SELECT COUNT(*) FROM summaries AS m WHERE m.user_id = s.user_id"
    "  AND m.session_id = s.session_id AND m.superseded_by IS NULL),"
    f" COALESCE((SELECT substr(t.content, 1, {TITLE_CHARS}) FROM turns AS t"
    "  WHERE t.user_id = s.user_id AND t.session_id = s.session_id AND t.role = 'user'"
    "  ORDER BY t.id LIMIT 1), '')"
    " FROM sessions AS s"
)


class SessionStore:
    """Reads and deletes one user's sessions."""

    def __init__(self, store: Store, *, notify: Callable[[], None]) -> None:
        self.store = store
        self.notify = notify

    async def list(
        self, user_id: str, *, limit: int = 50, cursor: str | None = None
    ) -> tuple[builtins.list[SessionInfo], str | None]:
        """A page of sessions, most recently active first, and the next page's cursor."""
        where = "s.user_id = ?"
        params: builtins.list[Any] = [user_id]
        if cursor is not None:
            last_active, session_id = _decode(cursor)
            where += " AND (s.last_active < ? OR (s.last_active = ? AND s.session_id < ?))"
            params += [last_active, last_active, session_id]
        rows = await self.store.read(
            f"{_SELECT} WHERE {where} ORDER BY s.last_active DESC, s.session_id DESC LIMIT ?",
            (*params, limit + 1),
        )
        found = [SessionInfo(*row) for row in rows[:limit]]
        more = len(rows) > limit
        return found, _encode(found[-1].last_active, found[-1].session_id) if more else None

    async def get(self, user_id: str, session_id: str) -> SessionInfo | None:
        """One session with its counts, or None."""
        rows = await self.store.read(
            f"{_SELECT} WHERE s.user_id = ? AND s.session_id = ?", (user_id, session_id)
        )
        return SessionInfo(*rows[0]) if rows else None

    async def turns(
        self, user_id: str, session_id: str, *, limit: int = 100, after: int = 0
    ) -> tuple[builtins.list[Turn], int | None]:
        """A page of the session's turns in the order they were stored, and the next `after`."""
        rows = await self.store.read(
            "SELECT id FROM turns WHERE user_id = ? AND session_id = ? AND id > ?"
            " ORDER BY id LIMIT ?",
            (user_id, session_id, after, limit + 1),
        )
        ids = [int(row[0]) for row in rows[:limit]]
        turns = await self.store.get_turns(ids)
        return turns, ids[-1] if len(rows) > limit else None

    async def delete(self, user_id: str, session_id: str) -> dict[str, int] | None:
        """Forget the session (see memory.forget.forget_session); None when unknown."""
        async with self.store.write() as tx:
            removed = await forget_session(tx, user_id, session_id)
        if removed is not None:
            self.notify()
        return removed


def turn_dict(turn: Turn) -> dict[str, Any]:
    """A turn as the API shows it (no user id, no content hash)."""
    return {
        "id": turn.id, "session_id": turn.session_id, "parent_id": turn.parent_id,
        "position": turn.position, "role": turn.role, "name": turn.name,
        "content": turn.content, "created_at": turn.created_at, "model": turn.model,
        "tokens": turn.tokens, "incomplete": turn.incomplete,
    }


def _encode(last_active: float, session_id: str) -> str:
    # `<last_active>:<session id as hex>`: every string of this shape is a valid cursor.
    return f"{last_active!r}:{session_id.encode().hex()}"


def _decode(cursor: str) -> tuple[float, str]:
    if not CURSOR.fullmatch(cursor):
        raise CursorError("invalid cursor")
    time_text, _, hex_id = cursor.partition(":")
    return float(time_text), bytes.fromhex(hex_id).decode("utf-8", "replace")
