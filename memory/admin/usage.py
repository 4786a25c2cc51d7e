"""Usage per day, key and user (table `usage_daily`, memory/storage/usage.py): what the
proxy's meter adds, what the admin API reports, what quotas read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memory.storage import usage
from memory.storage.database import Database
from memory.storage.usage import UsageCounts, UsageRow


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
        by_key = await usage.totals(self.db, first_day, last_day, group="key_id", key_id=key_id,
                                    user_id=user_id, limit=limit)
        by_user = await usage.totals(self.db, first_day, last_day, group="user_id",
                                     key_id=key_id, user_id=user_id, limit=limit)
        total = await usage.totals(self.db, first_day, last_day, group=None, key_id=key_id,
                                   user_id=user_id)
        return UsageReport(found[:limit], len(found) > limit, by_key, by_user, total[0][1])

    async def tokens_since(self, key_ids: Sequence[str], first_day: str) -> dict[str, int]:
        """{key_id: input + output tokens from `first_day` (YYYY-MM-DD) on}."""
        return await usage.tokens_since(self.db, key_ids, first_day)
