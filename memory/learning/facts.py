"""Facts: short third-person statements about a user, versioned, with a lifecycle.

A fact is a chain of versions. `edit` (and a contradiction found by learning) inserts a new
version and closes the old one with `valid_to` + `superseded_by`; the old one stays as
history and is never recalled. `delete` removes the whole chain. Every change queues a
durable `sync_vectors` job in the same transaction, which brings the fact's vectors in line
with the database (upsert active versions, delete the rest), so vectors never outlive rows
for longer than one job.

Expiry: `expires_at` is set explicitly, or for extracted facts from the category's
lifetime. Pinned facts never expire and are never evicted; at most `max_pinned` per user.

The SQL is memory.storage.facts'; errors and checks live in `memory.learning.fact_model`.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from memory.learning.fact_model import (
    CATEGORIES,
    DAY,
    MAX_CLIENT_CHARS,
    MAX_PAGE,
    MAX_TEXT_CHARS,
    SOURCES,
    SYNC_JOB,
    FactError,
    FactNotFound,
    check_category,
    check_fields,
    check_text,
    parse_cursor,
    queue_sync,
)
from memory.redact import keep
from memory.storage import facts
from memory.storage.database import Connection, Database, Transaction
from memory.storage.facts import Fact, NewFact
from memory.storage.fts import search_terms

__all__ = [
    "CATEGORIES", "DAY", "MAX_CLIENT_CHARS", "MAX_PAGE", "MAX_TEXT_CHARS", "SOURCES", "SYNC_JOB",
    "Fact", "FactError", "FactNotFound", "FactStore", "queue_sync",
]


@dataclass(eq=False)
class FactStore:
    """Facts of every user, always read and written scoped to one user."""

    db: Database
    _: KW_ONLY
    lifetimes_days: Mapping[str, float] = field(default_factory=dict)
    max_pinned: int = 10
    redact: Callable[[str], str] = keep
    notify: Callable[[], None] = lambda: None

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
        client: str | None = None,
    ) -> Fact:
        """Store a new fact (version 1 of a new chain); `client` names the MCP client that
        added it (provenance, with source 'mcp')."""
        text = self.redact(check_text(text))
        check_fields(category, confidence, importance)
        if source not in SOURCES:
            raise FactError(f"source must be one of {', '.join(SOURCES)}", "source")
        if client is not None and len(client) > MAX_CLIENT_CHARS:
            raise FactError(f"client must be at most {MAX_CLIENT_CHARS} characters", "client")
        now = time.time()
        if expires_at is None and source == "extracted":
            expires_at = self.default_expiry(category, now)
        async with self.db.write() as tx:
            if pinned:
                await self._check_pin_room(tx, user_id)
            fact_id = await facts.insert(tx, NewFact(
                user_id, text, category, confidence, importance, source,
                source_session=source_session, source_turn_ids=source_turn_ids, pinned=pinned,
                first_seen=now, last_seen=now, expires_at=expires_at, valid_from=now,
                created_at=now, updated_at=now, client=client,
            ))
            await queue_sync(tx, facts=[fact_id])
        self.notify()
        return await self._must_get(user_id, fact_id)

    async def get(self, user_id: str, fact_id: int) -> Fact | None:
        """One version of one of this user's facts, or None."""
        return await facts.get(self.db, user_id, fact_id)

    async def get_many(self, user_id: str, ids: Sequence[int]) -> builtins.list[Fact]:
        """These facts of this user, in the order asked; unknown ids are skipped."""
        if not ids:
            return []
        found = {fact.id: fact for fact in await facts.get_many(self.db, user_id, ids)}
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
        if category is not None:
            check_category(category)
        if query and not search_terms(query):
            return [], None
        found = await facts.page(
            self.db, user_id, limit=limit + 1, category=category, pinned=pinned, query=query,
            active_at=None if include_inactive else time.time(),
            before=None if cursor is None else parse_cursor(cursor),
        )
        return found[:limit], str(found[limit - 1].id) if len(found) > limit else None

    async def active(self, user_id: str) -> builtins.list[Fact]:
        """Every active fact of this user, newest first."""
        return await facts.active(self.db, user_id, time.time())

    async def search(self, user_id: str, query: str, *, k: int) -> builtins.list[tuple[int, float]]:
        """Best `k` (fact_id, bm25) among this user's active facts, best first."""
        return await facts.search(self.db, user_id, query, k=k, now=time.time())

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
        client: str | None = None,
    ) -> Fact:
        """Replace the current version `fact_id` with a new one in the same chain.

        `restart` (a contradiction, not an edit): the new version starts its own mentions,
        first-seen time and source turns instead of inheriting them.
        """
        text = self.redact(text)
        now = time.time()
        async with self.db.write() as tx:
            old = await self._must_get(user_id, fact_id, tx)
            # Never None: the row was just read in this transaction, and chain_id is NOT NULL.
            chain_id = await facts.chain_of(tx, user_id, fact_id)
            if old.valid_to is not None:
                raise FactError(
                    f"fact {fact_id} is an old version (superseded by {old.superseded_by});"
                    " edit the current one", "fact_id",
                )
            turns = {*([] if restart else old.source_turn_ids), *source_turn_ids}
            mentions, first_seen = (1, now) if restart else (old.mentions, old.first_seen)
            new_id = await facts.insert(tx, NewFact(
                user_id, text, category, confidence, importance, source or old.source,
                source_session=source_session or old.source_session, source_turn_ids=turns,
                client=old.client if source is None else client,
                mentions=mentions, pinned=old.pinned, first_seen=first_seen, last_seen=now,
                expires_at=expires_at, version=old.version + 1, previous_id=old.id,
                valid_from=now, created_at=now, updated_at=now, chain_id=chain_id,
            ))
            await facts.close(tx, fact_id, superseded_by=new_id, now=now)
            await queue_sync(tx, facts=[fact_id, new_id])
        self.notify()
        return await self._must_get(user_id, new_id)

    async def merge(
        self, user_id: str, fact_id: int, *, confidence_step: float,
        source_turn_ids: Sequence[int] = (), expires_at: float | None = None,
    ) -> Fact:
        """Count one more mention: confidence rises by `confidence_step` (capped at 1)."""
        now = time.time()
        async with self.db.write() as tx:
            old = await self._must_get(user_id, fact_id, tx)
            turns = sorted({*old.source_turn_ids, *source_turn_ids})
            expiry = old.expires_at if expires_at is None or old.expires_at is None else max(
                float(old.expires_at), expires_at
            )
            await facts.add_mention(
                tx, fact_id, confidence_step=confidence_step, source_turn_ids=turns,
                expires_at=expiry, now=now,
            )
        return await self._must_get(user_id, fact_id)

    async def delete(self, user_id: str, fact_id: int) -> bool:
        """Delete the fact and its whole version chain (vectors follow by job)."""
        async with self.db.write() as tx:
            deleted = await facts.delete_chain(tx, user_id, fact_id)
            await queue_sync(tx, facts=deleted)
        self.notify()
        return bool(deleted)

    async def set_pinned(self, user_id: str, fact_id: int, pinned: bool) -> Fact:
        """Pin (never evicted, never expires) or unpin the current version of a fact."""
        now = time.time()
        async with self.db.write() as tx:
            old = await self._must_get(user_id, fact_id, tx)
            if old.valid_to is not None:
                raise FactError(f"fact {fact_id} is an old version; pin the current one", "fact_id")
            if pinned and not old.pinned:
                await self._check_pin_room(tx, user_id)
            await facts.set_pinned(tx, fact_id, pinned, now)
            await queue_sync(tx, facts=[fact_id])  # an expired fact pinned comes back
        self.notify()
        return await self._must_get(user_id, fact_id)

    async def history(self, user_id: str, fact_id: int) -> builtins.list[Fact]:
        """Every version of the fact's chain, oldest first ([] for an unknown id)."""
        return await facts.history(self.db, user_id, fact_id)

    async def count(self, user_id: str, *, active_only: bool = True) -> int:
        """How many facts this user has (active ones, or every version)."""
        return await facts.count(self.db, user_id, active_at=time.time() if active_only else None)

    def default_expiry(self, category: str, now: float) -> float | None:
        """When an extracted fact of `category` seen at `now` expires (None: never)."""
        days = self.lifetimes_days.get(category)
        return None if not days else now + days * DAY

    async def _check_pin_room(self, tx: Transaction, user_id: str) -> None:
        if await facts.count_pinned(tx, user_id) >= self.max_pinned:
            raise FactError(
                f"at most {self.max_pinned} facts can be pinned; unpin one first", "pinned"
            )

    async def _must_get(self, user_id: str, fact_id: int, conn: Connection | None = None) -> Fact:
        fact = await facts.get(self.db if conn is None else conn, user_id, fact_id)
        if fact is None:
            raise FactNotFound(f"no fact {fact_id}", "fact_id")
        return fact
