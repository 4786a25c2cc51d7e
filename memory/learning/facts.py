"""Facts: short third-person statements about a user, versioned, with a lifecycle.

A fact is a chain of versions. `edit` (and a contradiction found by learning) inserts a new
version and closes the old one with `valid_to` + `superseded_by`; the old one stays as
history and is never recalled. `delete` removes the whole chain. Every change queues a
durable `sync_vectors` job in the same transaction, which brings the fact's vectors in line
with the database (upsert active versions, delete the rest), so vectors never outlive rows
for longer than one job.

Expiry: `expires_at` is set explicitly, or for extracted facts from the category's
lifetime. Pinned facts never expire and are never evicted; at most `max_pinned` per user.

The record, errors and checks live in `memory.fact_model` and are re-exported here.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memory.learning.fact_model import (
    ACTIVE_SQL,
    CATEGORIES,
    DAY,
    MAX_PAGE,
    MAX_TEXT_CHARS,
    SOURCES,
    SYNC_JOB,
    Fact,
    FactError,
    FactNotFound,
    check_category,
    check_fields,
    check_text,
    fact_from_row,
    parse_cursor,
    queue_sync,
)
from memory.storage.store import Store, Transaction, match_expression, owner_token

__all__ = [
    "ACTIVE_SQL", "CATEGORIES", "DAY", "MAX_PAGE", "MAX_TEXT_CHARS", "SOURCES", "SYNC_JOB",
    "Fact", "FactError", "FactNotFound", "FactStore", "facts_by_id", "queue_sync",
]

_COLUMNS = (
    "id, user_id, text, category, confidence, importance, mentions, source, source_session, "
    "source_turn_ids, pinned, first_seen, last_seen, expires_at, version, previous_id, "
    "valid_from, valid_to, superseded_by, created_at, updated_at"
)

class FactStore:
    """Facts of every user, always read and written scoped to one user."""

    def __init__(
        self,
        store: Store,
        *,
        lifetimes_days: Mapping[str, float] | None = None,
        max_pinned: int = 10,
        notify: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.lifetimes_days = dict(lifetimes_days or {})
        self.max_pinned = max_pinned
        self._notify = notify or (lambda: None)

    async def add(
        self,
        user_id: str,
        text: str,
        category: str,
        *,
        confidence: float = 0.6,
        importance: int = 5,
        source: str = "manual",
        source_session: str | None = None,
        source_turn_ids: Sequence[int] = (),
        pinned: bool = False,
        expires_at: float | None = None,
    ) -> Fact:
        """Store a new fact (version 1 of a new chain)."""
        text = self.store.redact(check_text(text))
        check_fields(category, confidence, importance)
        if source not in SOURCES:
            raise FactError(f"source must be one of {', '.join(SOURCES)}", "source")
        now = time.time()
        if expires_at is None and source == "extracted":
            expires_at = self.default_expiry(category, now)
        async with self.store.write() as tx:
            if pinned:
                await self._check_pin_room(tx, user_id, now)
            rows = await tx.execute(
                "INSERT INTO facts (chain_id, user_id, text, category, confidence, importance,"
                " mentions, source, source_session, source_turn_ids, pinned, first_seen,"
                " last_seen, expires_at, version, valid_from, created_at, updated_at, owner)"
                " VALUES (0, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?) RETURNING id",
                (user_id, text, category, float(confidence), int(importance), source,
                 source_session, json.dumps(sorted(set(source_turn_ids))), int(pinned), now,
                 now, expires_at, now, now, now, owner_token(user_id)),
            )  # fmt: skip
            fact_id = int(rows[0][0])
            await tx.change("UPDATE facts SET chain_id = id WHERE id = ?", (fact_id,))
            await queue_sync(tx, facts=[fact_id])
        self._notify()
        return await self._must_get(user_id, fact_id)

    async def get(self, user_id: str, fact_id: int) -> Fact | None:
        """One version of one of this user's facts, or None."""
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM facts WHERE id = ? AND user_id = ?", (fact_id, user_id)
        )
        return fact_from_row(rows[0]) if rows else None

    async def get_many(self, user_id: str, ids: Sequence[int]) -> builtins.list[Fact]:
        """These facts of this user, in the order asked; unknown ids are skipped."""
        if not ids:
            return []
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM facts WHERE user_id = ? AND id IN"
            " (SELECT value FROM json_each(?))",
            (user_id, json.dumps(list(ids))),
        )
        found = {fact.id: fact for fact in map(fact_from_row, rows)}
        return [found[i] for i in ids if i in found]

    async def list(
        self,
        user_id: str,
        *,
        category: str | None = None,
        pinned: bool | None = None,
        query: str | None = None,
        include_inactive: bool = False,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[builtins.list[Fact], str | None]:
        """A page of this user's facts, newest first, and the cursor of the next page."""
        if not 1 <= limit <= MAX_PAGE:
            raise FactError(f"limit must be between 1 and {MAX_PAGE}", "limit")
        where: builtins.list[str] = ["user_id = ?"]
        params: builtins.list[Any] = [user_id]
        if category is not None:
            check_category(category)
            where.append("category = ?")
            params.append(category)
        if pinned is not None:
            where.append("pinned = ?")
            params.append(int(pinned))
        if not include_inactive:
            where.append(ACTIVE_SQL)
            params.append(time.time())
        if query:
            expression = match_expression(user_id, query)
            if expression is None:
                return [], None
            where.append("id IN (SELECT rowid FROM facts_fts WHERE facts_fts MATCH ?)")
            params.append(expression)
        if cursor is not None:
            where.append("id < ?")
            params.append(parse_cursor(cursor))
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM facts WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?",
            (*params, limit + 1),
        )
        facts = [fact_from_row(row) for row in rows[:limit]]
        return facts, str(facts[-1].id) if len(rows) > limit else None

    async def active(self, user_id: str) -> builtins.list[Fact]:
        """Every active fact of this user, newest first."""
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM facts WHERE user_id = ? AND {ACTIVE_SQL} ORDER BY id DESC",
            (user_id, time.time()),
        )
        return [fact_from_row(row) for row in rows]

    async def search(self, user_id: str, query: str, *, k: int) -> builtins.list[tuple[int, float]]:
        """Best `k` (fact_id, bm25) among this user's active facts, best first."""
        expression = match_expression(user_id, query)
        if expression is None or k <= 0:
            return []
        rows = await self.store.read(
            "SELECT f.id, -s.rank FROM facts_fts AS s JOIN facts AS f ON f.id = s.rowid"
            f" WHERE facts_fts MATCH ? AND f.user_id = ? AND {ACTIVE_SQL}"
            " ORDER BY s.rank LIMIT ?",
            (expression, user_id, time.time(), k),
        )
        return [(int(row[0]), float(row[1])) for row in rows]

    async def edit(
        self,
        user_id: str,
        fact_id: int,
        *,
        text: str | None = None,
        category: str | None = None,
        confidence: float | None = None,
        importance: int | None = None,
        expires_at: float | None = None,
    ) -> Fact:
        """Write a new version; the old one gets valid_to + superseded_by and stays as history."""
        old = await self._must_get(user_id, fact_id)
        changes: dict[str, Any] = {
            "text": old.text if text is None else check_text(text),
            "category": category or old.category,
            "confidence": old.confidence if confidence is None else confidence,
            "importance": old.importance if importance is None else importance,
            "expires_at": old.expires_at if expires_at is None else expires_at,
        }
        check_fields(changes["category"], changes["confidence"], changes["importance"])
        return await self.supersede(user_id, fact_id, **changes)

    async def supersede(
        self,
        user_id: str,
        fact_id: int,
        *,
        text: str,
        category: str,
        confidence: float,
        importance: int,
        expires_at: float | None,
        source: str | None = None,
        source_session: str | None = None,
        source_turn_ids: Sequence[int] = (),
        restart: bool = False,
    ) -> Fact:
        """Replace the current version `fact_id` with a new one in the same chain.

        `restart` (a contradiction, not an edit): the new version starts its own mentions,
        first-seen time and source turns instead of inheriting them.
        """
        text = self.store.redact(text)
        now = time.time()
        async with self.store.write() as tx:
            old_rows = await tx.execute(
                f"SELECT {_COLUMNS}, chain_id FROM facts WHERE id = ? AND user_id = ?",
                (fact_id, user_id),
            )
            if not old_rows:
                raise FactNotFound(f"no fact {fact_id}", "fact_id")
            old = fact_from_row(old_rows[0][:-1])
            if old.valid_to is not None:
                raise FactError(
                    f"fact {fact_id} is an old version (superseded by {old.superseded_by});"
                    " edit the current one", "fact_id",
                )
            turns = sorted({*([] if restart else old.source_turn_ids), *source_turn_ids})
            mentions, first_seen = (1, now) if restart else (old.mentions, old.first_seen)
            rows = await tx.execute(
                "INSERT INTO facts (chain_id, user_id, text, category, confidence, importance,"
                " mentions, source, source_session, source_turn_ids, pinned, first_seen,"
                " last_seen, expires_at, version, previous_id, valid_from, created_at,"
                " updated_at, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
                " ?, ?, ?) RETURNING id",
                (old_rows[0][-1], user_id, text, category, float(confidence), int(importance),
                 mentions, source or old.source, source_session or old.source_session,
                 json.dumps(turns), int(old.pinned), first_seen, now, expires_at,
                 old.version + 1, old.id, now, now, now, owner_token(user_id)),
            )  # fmt: skip
            new_id = int(rows[0][0])
            await tx.change(
                "UPDATE facts SET valid_to = ?, superseded_by = ?, updated_at = ? WHERE id = ?",
                (now, new_id, now, fact_id),
            )
            await queue_sync(tx, facts=[fact_id, new_id])
        self._notify()
        return await self._must_get(user_id, new_id)

    async def merge(
        self, user_id: str, fact_id: int, *, confidence_step: float,
        source_turn_ids: Sequence[int] = (), expires_at: float | None = None,
    ) -> Fact:
        """Count one more mention: confidence rises by `confidence_step` (capped at 1)."""
        now = time.time()
        async with self.store.write() as tx:
            rows = await tx.execute(
                "SELECT source_turn_ids, expires_at FROM facts WHERE id = ? AND user_id = ?",
                (fact_id, user_id),
            )
            if not rows:
                raise FactNotFound(f"no fact {fact_id}", "fact_id")
            turns = sorted({*json.loads(rows[0][0]), *source_turn_ids})
            expiry = rows[0][1] if expires_at is None or rows[0][1] is None else max(
                float(rows[0][1]), expires_at
            )
            await tx.change(
                "UPDATE facts SET mentions = mentions + 1, confidence = MIN(1.0, confidence + ?),"
                " last_seen = ?, updated_at = ?, source_turn_ids = ?, expires_at = ? WHERE id = ?",
                (confidence_step, now, now, json.dumps(turns), expiry, fact_id),
            )
        return await self._must_get(user_id, fact_id)

    async def delete(self, user_id: str, fact_id: int) -> bool:
        """Delete the fact and its whole version chain (vectors follow by job)."""
        async with self.store.write() as tx:
            rows = await tx.execute(
                "DELETE FROM facts WHERE user_id = ? AND chain_id ="
                " (SELECT chain_id FROM facts WHERE id = ? AND user_id = ?) RETURNING id",
                (user_id, fact_id, user_id),
            )
            await queue_sync(tx, facts=[int(row[0]) for row in rows])
        self._notify()
        return bool(rows)

    async def set_pinned(self, user_id: str, fact_id: int, pinned: bool) -> Fact:
        """Pin (never evicted, never expires) or unpin the current version of a fact."""
        now = time.time()
        async with self.store.write() as tx:
            rows = await tx.execute(
                "SELECT pinned, valid_to FROM facts WHERE id = ? AND user_id = ?",
                (fact_id, user_id),
            )
            if not rows:
                raise FactNotFound(f"no fact {fact_id}", "fact_id")
            if rows[0][1] is not None:
                raise FactError(f"fact {fact_id} is an old version; pin the current one", "fact_id")
            if pinned and not rows[0][0]:
                await self._check_pin_room(tx, user_id, now)
            await tx.change(
                "UPDATE facts SET pinned = ?, updated_at = ? WHERE id = ?",
                (int(pinned), now, fact_id),
            )
            await queue_sync(tx, facts=[fact_id])  # an expired fact pinned comes back
        self._notify()
        return await self._must_get(user_id, fact_id)

    async def history(self, user_id: str, fact_id: int) -> builtins.list[Fact]:
        """Every version of the fact's chain, oldest first ([] for an unknown id)."""
        rows = await self.store.read(
            f"SELECT {_COLUMNS} FROM facts WHERE user_id = ? AND chain_id ="
            " (SELECT chain_id FROM facts WHERE id = ? AND user_id = ?) ORDER BY version",
            (user_id, fact_id, user_id),
        )
        return [fact_from_row(row) for row in rows]

    async def count(self, user_id: str, *, active_only: bool = True) -> int:
        """How many facts this user has (active ones, or every version)."""
        if active_only:
            rows = await self.store.read(
                f"SELECT COUNT(*) FROM facts WHERE user_id = ? AND {ACTIVE_SQL}",
                (user_id, time.time()),
            )
        else:
            rows = await self.store.read(
                "SELECT COUNT(*) FROM facts WHERE user_id = ?", (user_id,)
            )
        return int(rows[0][0])

    def default_expiry(self, category: str, now: float) -> float | None:
        """When an extracted fact of `category` seen at `now` expires (None: never)."""
        days = self.lifetimes_days.get(category)
        return None if not days else now + days * DAY

    async def _check_pin_room(self, tx: Transaction, user_id: str, now: float) -> None:
        rows = await tx.execute(
            f"SELECT COUNT(*) FROM facts WHERE user_id = ? AND pinned = 1 AND {ACTIVE_SQL}",
            (user_id, now),
        )
        if int(rows[0][0]) >= self.max_pinned:
            raise FactError(
                f"at most {self.max_pinned} facts can be pinned; unpin one first", "pinned"
            )

    async def _must_get(self, user_id: str, fact_id: int) -> Fact:
        fact = await self.get(user_id, fact_id)
        if fact is None:
            raise FactNotFound(f"no fact {fact_id}", "fact_id")
        return fact


async def facts_by_id(store: Store, ids: Sequence[int]) -> list[Fact]:
    """Facts with these ids, any user (for background jobs)."""
    rows = await store.read(
        f"SELECT {_COLUMNS} FROM facts WHERE id IN (SELECT value FROM json_each(?))",
        (json.dumps(list(ids)),),
    )
    return [fact_from_row(row) for row in rows]
