"""Usage per day, key and user (table `usage_daily`, memory/storage/usage.py): what the
proxy's meter adds, what the admin API reports, what quotas read; and the reservations of a
quota key's running requests (memory/storage/reservations.py), taken and settled against
it in one transaction each, so replicas never admit past a quota together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from memory.storage import reservations, usage
from memory.storage.database import Database
from memory.storage.usage import UsageCounts, UsageRow


@dataclass(frozen=True)
class Hold:
    """A quota key's month when a request asked to be admitted."""

    used: int  # tokens spent this month, every replica's written counts
    held: int  # tokens other running requests have reserved
    hold_id: str | None  # the request's reservation; None when it was refused


@dataclass(frozen=True)
class UsageReport:
    """Rows of a day range and their sums per key, per user and in all."""

    rows: list[UsageRow]
    has_more: bool  # more rows than the limit matched (the sums count them all)
    by_key: list[tuple[str, UsageCounts]]
    by_user: list[tuple[str, UsageCounts]]
    totals: UsageCounts


class UsageLedger:
    """The usage table behind one database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def add(self, rows: Sequence[UsageRow]) -> None:
        """Add a batch of counts in one transaction."""
        if rows:
            async with self.db.write() as tx:
                await usage.add(tx, rows)

    async def report(
        self, first_day: str, last_day: str, *, key_id: str | None, user_id: str | None,
        limit: int,
    ) -> UsageReport:
        """The days [first_day, last_day] (YYYY-MM-DD), filtered by key and user."""
        found = await usage.rows(self.db, first_day, last_day, key_id=key_id, user_id=user_id,
                                 limit=limit + 1)
        totals = partial(usage.totals, self.db, first_day, last_day, key_id=key_id, user_id=user_id)
        by_key = await totals(group="key_id", limit=limit)
        by_user = await totals(group="user_id", limit=limit)
        total = await totals(group=None)
        return UsageReport(found[:limit], len(found) > limit, by_key, by_user, total[0][1])

    async def tokens_since(self, key_ids: Sequence[str], first_day: str) -> dict[str, int]:
        """{key_id: input + output tokens from `first_day` (YYYY-MM-DD) on}."""
        return await usage.tokens_since(self.db, key_ids, first_day)

    async def reserve(
        self, key_id: str, *, first_day: str, quota: int, tokens: int, hold_id: str,
        now: float, expires_at: float,
    ) -> Hold:
        """Reserve `tokens` for a request of `key_id` unless its month (spent plus held) has
        reached `quota`; one transaction, so every replica's reservations are seen."""
        async with self.db.write() as tx:
            held = await reservations.held(tx, key_id, now)
            used = (await usage.tokens_since(tx, [key_id], first_day))[key_id]
            if used + held >= quota:
                return Hold(used, held, None)
            await reservations.add(tx, hold_id, key_id, tokens, expires_at)
        return Hold(used, held, hold_id)

    async def settle(self, hold_id: str, row: UsageRow) -> None:
        """End a reservation and add what its request spent, in one transaction: its tokens
        are never counted twice nor missed by a replica reading between."""
        async with self.db.write() as tx:
            await reservations.remove(tx, hold_id)
            await usage.add(tx, [row])
