"""Tables `summaries` and `summaries_fts`: rolling session summaries
(memory.learning.summaries).

A session's newest summary is its current one; the ones before it point at it with
`superseded_by` and are kept as history only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, fields
from typing import Any

from memory.storage import pg_search
from memory.storage.database import (
    Connection,
    Row,
    Transaction,
    column,
    equal_to,
    in_values,
    marks,
    scalar,
)
from memory.storage.fts import match_expression, owner_token, search_terms, session_token


@dataclass(frozen=True)
class Summary:
    """One summary of a session up to `last_turn_id`; `data` holds the structured lists."""

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
        return asdict(self)


_COLUMNS = ", ".join(f.name for f in fields(Summary))


@dataclass(frozen=True)
class NewSummary:
    """A summary to insert."""

    user_id: str
    session_id: str
    text: str
    data: Mapping[str, Any]
    _: KW_ONLY
    source_turn_ids: Sequence[int]
    last_turn_id: int
    user_turns: int
    tokens: int
    created_at: float


async def insert(tx: Transaction, summary: NewSummary) -> int:
    """Store one summary and return its id."""
    row = {f.name: getattr(summary, f.name) for f in fields(summary)} | {
        "data": json.dumps(summary.data),
        "source_turn_ids": json.dumps(sorted(set(summary.source_turn_ids))),
        "owner": owner_token(summary.user_id),
        "sess": session_token(summary.user_id, summary.session_id),
    }
    sql = f"INSERT INTO summaries ({', '.join(row)}) VALUES ({marks(len(row))}) RETURNING id"
    return await scalar(tx, int, sql, list(row.values()))


async def supersede_others(
    tx: Transaction, user_id: str, session_id: str, current: int
) -> list[int]:
    """Make `current` the session's only current summary; return the ids it replaced."""
    return await column(
        tx, int, "UPDATE summaries SET superseded_by = ? WHERE user_id = ? AND session_id = ?"
        " AND id != ? AND superseded_by IS NULL RETURNING id",
        (current, user_id, session_id, current),
    )


async def set_superseded_by(tx: Transaction, summary_id: int, successor: int) -> None:
    """Point a summary at its successor (imports rebuild history this way)."""
    await tx.change(
        "UPDATE summaries SET superseded_by = ? WHERE id = ?", (successor, summary_id)
    )


async def of_user(
    conn: Connection, user_id: str, session_id: str | None = None, *, history: bool = False
) -> list[Summary]:
    """This user's summaries (of one session; current ones unless `history`), newest first."""
    where, params = equal_to(user_id=user_id, session_id=session_id)
    current = "" if history else " AND superseded_by IS NULL"
    sql = f"SELECT {_COLUMNS} FROM summaries WHERE {where}{current} ORDER BY id DESC"
    return [_summary(row) for row in await conn.fetch(sql, params)]


async def get(conn: Connection, user_id: str, summary_id: int) -> Summary | None:
    """One of this user's summaries, or None."""
    sql = f"SELECT {_COLUMNS} FROM summaries WHERE id = ? AND user_id = ?"
    return next(map(_summary, await conn.fetch(sql, (summary_id, user_id))), None)


async def get_many(conn: Connection, user_id: str | None, ids: Sequence[int]) -> list[Summary]:
    """These summaries (of this user, or of anyone for background jobs), in no set order."""
    among, values = in_values(conn, ids)
    scope, params = equal_to(user_id=user_id)
    sql = f"SELECT {_COLUMNS} FROM summaries WHERE id {among} AND {scope}"
    return [_summary(row) for row in await conn.fetch(sql, (values, *params))]


async def search(
    conn: Connection, user_id: str, query: str, *, k: int, session_id: str | None = None
) -> list[tuple[int, float]]:
    """Best `k` (summary_id, bm25) among current summaries in scope, best first."""
    expression = match_expression(user_id, query, session_id)
    if expression is None or k <= 0:
        return []
    if conn.dialect == "postgres":
        scope, params = equal_to(user_id=user_id, session_id=session_id)
        sql = pg_search.bm25_sql("summaries", scope + " AND superseded_by IS NULL")
        rows = await conn.fetch(sql, (search_terms(query), *params, k))
    else:
        rows = await conn.fetch(
            "SELECT s.id, -f.rank FROM summaries_fts AS f JOIN summaries AS s ON s.id = f.rowid"
            " WHERE summaries_fts MATCH ? AND s.user_id = ? AND s.superseded_by IS NULL"
            " ORDER BY f.rank LIMIT ?",
            (expression, user_id, k),
        )
    return [(int(row[0]), float(row[1])) for row in rows]


async def exists(
    conn: Connection, user_id: str, session_id: str, text: str, created_at: float | None
) -> bool:
    """Whether the session has a summary with this text (and creation time, when given)."""
    where, params = equal_to(
        user_id=user_id, session_id=session_id, text=text, created_at=created_at
    )
    return bool(await conn.fetch(f"SELECT 1 FROM summaries WHERE {where} LIMIT 1", params))


async def has_any(conn: Connection, user_id: str) -> bool:
    """Whether this user has any summary."""
    sql = "SELECT EXISTS(SELECT 1 FROM summaries WHERE user_id = ?)"
    return await scalar(conn, bool, sql, (user_id,))


async def count_current(conn: Connection, user_id: str) -> int:
    """How many current summaries this user has."""
    sql = "SELECT COUNT(*) FROM summaries WHERE user_id = ? AND superseded_by IS NULL"
    return await scalar(conn, int, sql, (user_id,))


async def count_by_session(
    conn: Connection, user_id: str, session_ids: Sequence[str]
) -> dict[str, int]:
    """How many current summaries each of these sessions has (absent: none)."""
    among, values = in_values(conn, session_ids)
    rows = await conn.fetch(
        "SELECT session_id, COUNT(*) FROM summaries WHERE user_id = ?"
        f" AND superseded_by IS NULL AND session_id {among} GROUP BY session_id",
        (user_id, values),
    )
    return {str(row[0]): int(row[1]) for row in rows}


async def current_ids(conn: Connection) -> list[int]:
    """Ids of every current summary of every user, ascending (backups rebuild from them)."""
    sql = "SELECT id FROM summaries WHERE superseded_by IS NULL ORDER BY id"
    return await column(conn, int, sql)


async def delete(
    tx: Transaction, user_id: str, *, session_id: str | None = None,
    summary_id: int | None = None,
) -> list[int]:
    """Delete this user's summaries: all, one session's, or one; return their ids."""
    where, params = equal_to(user_id=user_id, session_id=session_id, id=summary_id)
    return await column(tx, int, f"DELETE FROM summaries WHERE {where} RETURNING id", params)


def _summary(row: Row) -> Summary:
    values = list(row)
    values[4] = json.loads(values[4])
    values[5] = json.loads(values[5])
    return Summary(*values)
