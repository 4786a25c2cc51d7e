"""Tables `facts` and `facts_fts`: versioned facts about users (memory.learning.facts).

A fact's versions share `chain_id`, the id of its first version. Every read is scoped to
one user except the few for background jobs, which say so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, fields
from typing import Any

from memory.storage import pg_search
from memory.storage.database import (
    Connection,
    Row,
    Transaction,
    column,
    equal_to,
    first,
    in_values,
    marks,
    scalar,
)
from memory.storage.fts import match_expression, owner_token, search_terms

# Active: the chain's current version, not expired (pinned facts never expire).
_ACTIVE = "valid_to IS NULL AND (pinned = 1 OR expires_at IS NULL OR expires_at > ?)"


@dataclass(frozen=True)
class Fact:
    """One version of a fact; times are unix seconds."""

    id: int
    user_id: str
    text: str
    category: str
    confidence: float
    importance: int
    mentions: int
    source: str
    source_session: str | None
    source_turn_ids: list[int]
    pinned: bool
    first_seen: float
    last_seen: float
    expires_at: float | None
    version: int
    previous_id: int | None
    valid_from: float
    valid_to: float | None
    superseded_by: int | None
    created_at: float
    updated_at: float
    client: str | None = None  # the MCP client that added it (source 'mcp'), as it named itself

    @property
    def expired(self) -> bool:
        """Past its expiry (pinned facts never are)."""
        return not self.pinned and self.expires_at is not None and self.expires_at <= time.time()

    @property
    def active(self) -> bool:
        """The current version and not expired: the only kind of fact ever recalled."""
        return self.valid_to is None and not self.expired

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return asdict(self) | {"active": self.active}


_COLUMNS = ", ".join(f.name for f in fields(Fact))


@dataclass(frozen=True)
class NewFact:
    """A fact version to insert; `chain_id` None starts a new chain (version 1's own id)."""

    user_id: str
    text: str
    category: str
    confidence: float
    importance: int
    source: str
    _: KW_ONLY
    first_seen: float
    last_seen: float
    valid_from: float
    created_at: float
    updated_at: float
    mentions: int = 1
    source_session: str | None = None
    source_turn_ids: Iterable[int] = ()
    pinned: bool = False
    expires_at: float | None = None
    version: int = 1
    previous_id: int | None = None
    valid_to: float | None = None
    chain_id: int | None = None
    client: str | None = None


async def insert(tx: Transaction, fact: NewFact) -> int:
    """Store one fact version and return its id."""
    row = {f.name: getattr(fact, f.name) for f in fields(fact)} | {
        "chain_id": fact.chain_id or 0,
        "confidence": float(fact.confidence),
        "importance": int(fact.importance),
        "source_turn_ids": json.dumps(sorted(set(fact.source_turn_ids))),
        "pinned": int(fact.pinned),
        "owner": owner_token(fact.user_id),
    }
    sql = f"INSERT INTO facts ({', '.join(row)}) VALUES ({marks(len(row))}) RETURNING id"
    fact_id = await scalar(tx, int, sql, list(row.values()))
    if fact.chain_id is None:
        await tx.change("UPDATE facts SET chain_id = id WHERE id = ?", (fact_id,))
    return fact_id


async def close(tx: Transaction, fact_id: int, *, superseded_by: int, now: float) -> None:
    """End a version: `valid_to` now, pointing at the version that replaces it."""
    await tx.change(
        "UPDATE facts SET valid_to = ?, superseded_by = ?, updated_at = ? WHERE id = ?",
        (now, superseded_by, now, fact_id),
    )


async def set_superseded_by(tx: Transaction, fact_id: int, successor: int) -> None:
    """Point a version at its successor (imports rebuild chains this way)."""
    await tx.change("UPDATE facts SET superseded_by = ? WHERE id = ?", (successor, fact_id))


async def add_mention(
    tx: Transaction, fact_id: int, *, confidence_step: float, source_turn_ids: Sequence[int],
    expires_at: float | None, now: float,
) -> None:
    """One more mention: confidence up by the step (capped at 1), seen now."""
    smaller = "LEAST" if tx.dialect == "postgres" else "MIN"
    await tx.change(
        f"UPDATE facts SET mentions = mentions + 1, confidence = {smaller}(1.0, confidence + ?),"
        " last_seen = ?, updated_at = ?, source_turn_ids = ?, expires_at = ? WHERE id = ?",
        (confidence_step, now, now, json.dumps(list(source_turn_ids)), expires_at, fact_id),
    )


async def set_pinned(tx: Transaction, fact_id: int, pinned: bool, now: float | None) -> None:
    """Pin or unpin one version, updated `now` (None: an import restoring a pin)."""
    await tx.change(
        "UPDATE facts SET pinned = ?, updated_at = COALESCE(?, updated_at) WHERE id = ?",
        (int(pinned), now, fact_id),
    )


async def get(conn: Connection, user_id: str, fact_id: int) -> Fact | None:
    """One version of one of this user's facts, or None."""
    sql = f"SELECT {_COLUMNS} FROM facts WHERE id = ? AND user_id = ?"
    return next(map(_fact, await conn.fetch(sql, (fact_id, user_id))), None)


async def chain_of(conn: Connection, user_id: str, fact_id: int) -> int | None:
    """The chain id of one of this user's facts, or None."""
    sql = "SELECT chain_id FROM facts WHERE id = ? AND user_id = ?"
    return await first(conn, int, sql, (fact_id, user_id))


async def get_many(conn: Connection, user_id: str | None, ids: Sequence[int]) -> list[Fact]:
    """These facts (of this user, or of anyone for background jobs), in no set order."""
    among, values = in_values(conn, ids)
    scope, params = equal_to(user_id=user_id)
    sql = f"SELECT {_COLUMNS} FROM facts WHERE id {among} AND {scope}"
    return [_fact(row) for row in await conn.fetch(sql, (values, *params))]


async def page(
    conn: Connection, user_id: str, *, limit: int, category: str | None = None,
    pinned: bool | None = None, query: str | None = None, active_at: float | None = None,
    before: int | None = None,
) -> list[Fact]:
    """Up to `limit` of this user's facts, newest first: of a category, pinned or not,
    matching free text, active at a time, with ids below `before` (each when given)."""
    scope, params = equal_to(
        user_id=user_id, category=category, pinned=None if pinned is None else int(pinned)
    )
    where = [scope]
    if active_at is not None:
        where.append(_ACTIVE)
        params.append(active_at)
    if query:
        expression = match_expression(user_id, query)
        if expression is None:
            return []
        if conn.dialect == "postgres":
            where.append(pg_search.MATCHES)
            params.append(search_terms(query))
        else:
            where.append("id IN (SELECT rowid FROM facts_fts WHERE facts_fts MATCH ?)")
            params.append(expression)
    if before is not None:
        where.append("id < ?")
        params.append(before)
    rows = await conn.fetch(
        f"SELECT {_COLUMNS} FROM facts WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?",
        (*params, limit),
    )
    return [_fact(row) for row in rows]


async def active(conn: Connection, user_id: str, now: float) -> list[Fact]:
    """Every fact of this user active at `now`, newest first."""
    sql = f"SELECT {_COLUMNS} FROM facts WHERE user_id = ? AND {_ACTIVE} ORDER BY id DESC"
    return [_fact(row) for row in await conn.fetch(sql, (user_id, now))]


async def search(
    conn: Connection, user_id: str, query: str, *, k: int, now: float
) -> list[tuple[int, float]]:
    """Best `k` (fact_id, bm25) among this user's active facts, best first."""
    expression = match_expression(user_id, query)
    if expression is None or k <= 0:
        return []
    if conn.dialect == "postgres":
        sql = pg_search.bm25_sql("facts", f"user_id = ? AND {_ACTIVE}")
        rows = await conn.fetch(sql, (search_terms(query), user_id, now, k))
    else:
        rows = await conn.fetch(
            "SELECT f.id, -s.rank FROM facts_fts AS s JOIN facts AS f ON f.id = s.rowid"
            f" WHERE facts_fts MATCH ? AND f.user_id = ? AND {_ACTIVE}"
            " ORDER BY s.rank LIMIT ?",
            (expression, user_id, now, k),
        )
    return [(int(row[0]), float(row[1])) for row in rows]


async def history(conn: Connection, user_id: str, fact_id: int) -> list[Fact]:
    """Every version of the fact's chain, oldest first ([] for an unknown id)."""
    sql = (f"SELECT {_COLUMNS} FROM facts WHERE user_id = ? AND chain_id ="
           " (SELECT chain_id FROM facts WHERE id = ? AND user_id = ?) ORDER BY version")
    return [_fact(row) for row in await conn.fetch(sql, (user_id, fact_id, user_id))]


async def count(conn: Connection, user_id: str, *, active_at: float | None = None) -> int:
    """How many facts this user has: active at `active_at`, or every version."""
    if active_at is None:
        return await scalar(conn, int, "SELECT COUNT(*) FROM facts WHERE user_id = ?", (user_id,))
    sql = f"SELECT COUNT(*) FROM facts WHERE user_id = ? AND {_ACTIVE}"
    return await scalar(conn, int, sql, (user_id, active_at))


async def count_pinned(conn: Connection, user_id: str) -> int:
    """How many current versions this user has pinned (pinned facts never expire)."""
    sql = "SELECT COUNT(*) FROM facts WHERE user_id = ? AND pinned = 1 AND valid_to IS NULL"
    return await scalar(conn, int, sql, (user_id,))


async def has_current(conn: Connection, user_id: str) -> bool:
    """Whether this user has any current version (expired or not)."""
    sql = "SELECT EXISTS(SELECT 1 FROM facts WHERE user_id = ? AND valid_to IS NULL)"
    return await scalar(conn, bool, sql, (user_id,))


async def count_by_session(
    conn: Connection, user_id: str, session_ids: Sequence[str]
) -> dict[str, int]:
    """How many current versions learned in each of these sessions (absent: none)."""
    among, values = in_values(conn, session_ids)
    rows = await conn.fetch(
        "SELECT source_session, COUNT(*) FROM facts WHERE user_id = ? AND valid_to IS NULL"
        f" AND source_session {among} GROUP BY source_session",
        (user_id, values),
    )
    return {str(row[0]): int(row[1]) for row in rows}


async def first_version(
    conn: Connection, user_id: str, text: str, category: str, first_seen: float
) -> int | None:
    """The id of the chain's first version with this text, category and first-seen time."""
    return await first(
        conn, int, "SELECT id FROM facts WHERE user_id = ? AND previous_id IS NULL AND text = ?"
        " AND category = ? AND first_seen = ? ORDER BY id LIMIT 1",
        (user_id, text, category, first_seen),
    )


async def current_exists(conn: Connection, user_id: str, text: str, category: str) -> bool:
    """Whether a current version has this text and category."""
    sql = (
        "SELECT 1 FROM facts WHERE user_id = ? AND text = ? AND category = ?"
        " AND valid_to IS NULL LIMIT 1"
    )
    return bool(await conn.fetch(sql, (user_id, text, category)))


async def session_chains(
    conn: Connection, user_id: str, session_id: str
) -> list[tuple[int, int, str | None, list[int]]]:
    """(id, chain_id, source_session, source_turn_ids) of every version of every chain
    that has a version learned in this session."""
    rows = await conn.fetch(
        "SELECT id, chain_id, source_session, source_turn_ids FROM facts WHERE user_id = ?"
        " AND chain_id IN (SELECT chain_id FROM facts WHERE user_id = ? AND source_session = ?)",
        (user_id, user_id, session_id),
    )
    return [(int(r[0]), int(r[1]), r[2], json.loads(r[3])) for r in rows]


async def expired_before(conn: Connection, older_than: float) -> list[tuple[str, int]]:
    """(user_id, id) of every current, unpinned version that expired before `older_than`."""
    rows = await conn.fetch(
        "SELECT user_id, id FROM facts WHERE valid_to IS NULL AND pinned = 0"
        " AND expires_at IS NOT NULL AND expires_at < ?",
        (older_than,),
    )
    return [(str(row[0]), int(row[1])) for row in rows]


async def users_above(conn: Connection, keep: int, now: float) -> list[str]:
    """Users with more than `keep` facts active at `now`."""
    sql = f"SELECT user_id FROM facts WHERE {_ACTIVE} GROUP BY user_id HAVING COUNT(*) > ?"
    return await column(conn, str, sql, (now, keep))


async def current_ids(conn: Connection) -> list[int]:
    """Ids of every current version of every user, ascending (backups rebuild from them)."""
    return await column(conn, int, "SELECT id FROM facts WHERE valid_to IS NULL ORDER BY id")


async def delete_chain(tx: Transaction, user_id: str, fact_id: int) -> list[int]:
    """Delete every version of the fact's chain; return their ids."""
    return await column(
        tx, int, "DELETE FROM facts WHERE user_id = ? AND chain_id ="
        " (SELECT chain_id FROM facts WHERE id = ? AND user_id = ?) RETURNING id",
        (user_id, fact_id, user_id),
    )


async def delete(tx: Transaction, user_id: str, ids: Sequence[int] | None = None) -> list[int]:
    """Delete these versions of this user's facts (all of them when None); return ids."""
    if ids is None:
        return await column(tx, int, "DELETE FROM facts WHERE user_id = ? RETURNING id", (user_id,))
    among, values = in_values(tx, ids)
    sql = f"DELETE FROM facts WHERE user_id = ? AND id {among} RETURNING id"
    return await column(tx, int, sql, (user_id, values))


def _fact(row: Row) -> Fact:
    values = list(row)
    values[9] = json.loads(values[9])  # source_turn_ids
    values[10] = bool(values[10])  # pinned
    return Fact(*values)
