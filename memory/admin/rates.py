"""Request-rate buckets every replica shares (table `rate_buckets`,
memory/storage/rate_buckets.py): what the proxy's key limits take from (docs/keys.md)."""

from __future__ import annotations

from memory.storage import rate_buckets
from memory.storage.database import Database


class SharedBuckets:
    """The rate buckets behind one database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def take(self, bucket: str, *, per_minute: float, capacity: float, now: float
                   ) -> float | None:
        """Take one request; None when taken, else the bucket's level (below 1)."""
        # One statement that commits on its own: no transaction's lock is needed for it.
        async with self.db.autocommit() as tx:
            return await rate_buckets.take(tx, bucket, per_minute=per_minute,
                                           capacity=capacity, now=now)
