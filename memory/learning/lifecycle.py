"""Fact lifecycle: the per-user cap, eviction order, and deleting long-expired facts.

Eviction removes a whole fact (every version) and picks, among the user's active facts that
are not pinned, the highest `eviction_score` first: days since last seen (plus one) times
the category's weight, divided by confidence. Old, low-confidence context goes first; a
recent, confident identity fact last. Facts the user wrote (manual, import) are evicted only
after every extracted one. Pinned facts are never evicted.

    weight  context 3 · todo 2 · decision 1 · preference 1 · project 1 · relationship 0.6
            · identity 0.5

Expired facts are no longer recalled at once; `fact_expired_retention_days` later they are
deleted.
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager

from memory.learning.facts import DAY, Fact, FactStore
from memory.storage import facts as fact_rows
from memory.storage.database import Database

CATEGORY_WEIGHT = {
    "context": 3.0, "todo": 2.0, "decision": 1.0, "preference": 1.0, "project": 1.0,
    "relationship": 0.6, "identity": 0.5,
}


def facts_lock(db: Database, user_id: str) -> AbstractAsyncContextManager[None]:
    """Held while one user's learned facts are merged, superseded or evicted: one job at a
    time on any replica (a database lock), so a dedup decision sees the last write."""
    return db.hold(f"facts:{user_id}")


def eviction_score(fact: Fact, now: float) -> float:
    """Higher goes first: age x category weight / confidence."""
    age_days = max(0.0, now - fact.last_seen) / DAY + 1.0
    return age_days * CATEGORY_WEIGHT.get(fact.category, 1.0) / max(fact.confidence, 0.05)


async def evict_down_to(facts: FactStore, user_id: str, keep: int, now: float | None = None) -> int:
    """Evict the user's lowest-value facts until at most `keep` are active; return how many."""
    now = time.time() if now is None else now
    active = await facts.active(user_id)
    excess = len(active) - keep
    if excess <= 0:
        return 0
    candidates = sorted(
        (f for f in active if not f.pinned),
        key=lambda f: (f.source == "extracted", eviction_score(f, now)), reverse=True,
    )
    return sum([await facts.delete(user_id, fact.id) for fact in candidates[:excess]])


async def purge_expired(facts: FactStore, older_than: float) -> int:
    """Delete facts (whole chains) that expired before `older_than`; return how many."""
    expired = await fact_rows.expired_before(facts.db, older_than)
    return sum([await facts.delete(user_id, fact_id) for user_id, fact_id in expired])


async def prune_all(facts: FactStore, keep: int, now: float | None = None) -> int:
    """Bring every user above `keep` active facts down to it; return how many were evicted."""
    now = time.time() if now is None else now
    users = await fact_rows.users_above(facts.db, keep, now)
    evicted = 0
    for user_id in users:
        async with facts_lock(facts.db, user_id):
            evicted += await evict_down_to(facts, user_id, keep, now)
    return evicted
