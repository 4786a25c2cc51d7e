"""Session summaries: structured JSON plus readable text, rolled up per session.

Each new summary of a session covers the whole session so far (the previous one is given to
the summariser and rolled in), so the previous summary gets `superseded_by` and is kept as
history only; recall uses a session's current summary.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memory.learning.facts import FactError, queue_sync
from memory.storage.store import Store, match_expression, owner_token, session_token

SUMMARY_KEYS = ("facts", "preferences", "decisions", "todos", "entities")
_COLUMNS = (
    "id, user_id, session_id, text, data, source_turn_ids, last_turn_id, user_turns, tokens, "
    "superseded_by, created_at"
)


@dataclass(frozen=True)
class Summary:
    """One summary of a session up to `last_turn_id`; `data` holds SUMMARY_KEYS lists."""

    id: int
    user_id: str
    session_id: str
    text: str
    data: dict[str, list[str]]
    source_turn_ids: list[int]
    last_turn_id: int
    user_turns: int
    tokens: int
    superseded_by: int | None
    created_at: float

    @property
    def current(self) -> bool:
        """Whether this is its session's latest summary."""
        return self.superseded_by is None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class SummaryStore:
    """Summaries of every user, always read and written scoped to one user."""

    def __init__(self, store: Store, *, notify: Callable[[], None] | None = None) -> None:
        self.store = store
        self._notify = notify or (lambda: None)

    async def list(
        self, user_id: str, session_id: str | None = None, *, include_history: bool = False
    ) -> builtins.list[Summary]:
        """This user's summaries (current ones unless asked), newest first."""
        where, params = ["user_id = ?"], [user_id]
        if session_id is not None:
            where.append("session_id = ?")
            params.append(session_id)
        if not include_history:
            where.append("superseded_by IS NULL")
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM summaries WHERE {' AND '.join(where)} ORDER BY id DESC",
            params,
        )
        return [_summary(row) for row in rows]

    async def get(self, user_id: str, summary_id: int) -> Summary | None:
        """One of this user's summaries, or None."""
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM summaries WHERE id = ? AND user_id = ?",
            (summary_id, user_id),
        )
        return _summary(rows[0]) if rows else None

    async def get_many(self, user_id: str, ids: Sequence[int]) -> builtins.list[Summary]:
        """These summaries of this user, in the order asked; unknown ids are skipped."""
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM summaries WHERE user_id = ? AND id IN"
            " (SELECT value FROM json_each(?))",
            (user_id, json.dumps(list(ids))),
        )
        found = {s.id: s for s in map(_summary, rows)}
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
        redact = self.store.redact
        text = redact(text)
        clean = {key: [redact(str(v)) for v in data.get(key, ())] for key in SUMMARY_KEYS}
        now = time.time()
        async with self.store.write() as tx:
            rows = await tx.execute(
                "INSERT INTO summaries (user_id, session_id, text, data, source_turn_ids,"
                " last_turn_id, user_turns, tokens, created_at, owner, sess)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (user_id, session_id, text.strip(), json.dumps(clean),
                 json.dumps(sorted(set(source_turn_ids))), last_turn_id, user_turns, tokens, now,
                 owner_token(user_id), session_token(user_id, session_id)),
            )  # fmt: skip
            new_id = int(rows[0][0])
            old = await tx.execute(
                "UPDATE summaries SET superseded_by = ? WHERE user_id = ? AND session_id = ?"
                " AND id != ? AND superseded_by IS NULL RETURNING id",
                (new_id, user_id, session_id, new_id),
            )
            await queue_sync(tx, summaries=[new_id, *(int(row[0]) for row in old)])
        self._notify()
        summary = await self.get(user_id, new_id)
        assert summary is not None
        return summary

    async def delete(self, user_id: str, summary_id: int) -> bool:
        """Delete one summary (vectors follow by job)."""
        async with self.store.write() as tx:
            rows = await tx.execute(
                "DELETE FROM summaries WHERE id = ? AND user_id = ? RETURNING id",
                (summary_id, user_id),
            )
            await queue_sync(tx, summaries=[int(row[0]) for row in rows])
        self._notify()
        return bool(rows)

    async def search(
        self, user_id: str, query: str, *, k: int, session_id: str | None = None
    ) -> builtins.list[tuple[int, float]]:
        """Best `k` (summary_id, bm25) among current summaries in scope, best first."""
        expression = match_expression(user_id, query, session_id)
        if expression is None or k <= 0:
            return []
        rows = await self.store.read(
            "SELECT s.id, -f.rank FROM summaries_fts AS f JOIN summaries AS s ON s.id = f.rowid"
            " WHERE summaries_fts MATCH ? AND s.user_id = ? AND s.superseded_by IS NULL"
            " ORDER BY f.rank LIMIT ?",
            (expression, user_id, k),
        )
        return [(int(row[0]), float(row[1])) for row in rows]


async def summaries_by_id(store: Store, ids: Sequence[int]) -> list[Summary]:
    """Summaries with these ids, any user (for background jobs)."""
    rows = await store.read(
        f"SELECT {_COLUMNS} FROM summaries WHERE id IN (SELECT value FROM json_each(?))",
        (json.dumps(list(ids)),),
    )
    return [_summary(row) for row in rows]


def _summary(row: Sequence[Any]) -> Summary:
    values = list(row)
    values[4] = json.loads(values[4])
    values[5] = json.loads(values[5])
    return Summary(*values)
