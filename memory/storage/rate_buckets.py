"""Table `rate_buckets`: one request-rate token bucket per proxy key, shared by every
replica (docs/keys.md, "Rate limits across replicas").

A bucket refills continuously at `per_minute` / 60 requests a second up to `capacity`.
Taking a request is one conditional upsert: the row lock (PostgreSQL) or the one writer
(SQLite) makes two replicas' takes of the last request exclusive, with no read before it.
Times are the replicas' own clocks; a clock behind the stored time refills nothing
instead of draining the bucket.
"""

from __future__ import annotations

from memory.storage.database import Transaction


async def take(
    tx: Transaction, bucket: str, *, per_minute: float, capacity: float, now: float
) -> float | None:
    """Take one request from `bucket`; None when taken, else its level (below 1) now."""
    least, greatest = ("LEAST", "GREATEST") if tx.dialect == "postgres" else ("MIN", "MAX")
    # The bucket's level now: its stored level plus the refill since, at most capacity.
    # Parameters, in order: capacity, now, per-second rate.
    level = f"{least}(?, rate_buckets.tokens + {greatest}(0, ? - rate_buckets.updated) * ?)"
    rate = per_minute / 60.0
    taken = await tx.fetch(
        "INSERT INTO rate_buckets (bucket, tokens, updated) VALUES (?, ?, ?)"
        f" ON CONFLICT (bucket) DO UPDATE SET tokens = {level} - 1,"
        f" updated = {greatest}(rate_buckets.updated, excluded.updated)"
        f" WHERE {level} >= 1 RETURNING tokens",
        (bucket, capacity - 1.0, now, capacity, now, rate, capacity, now, rate),
    )
    if taken:
        return None
    found = await tx.fetch(f"SELECT {level} FROM rate_buckets WHERE bucket = ?",
                           (capacity, now, rate, bucket))
    return float(found[0][0]) if found else 0.0
