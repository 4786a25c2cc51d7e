"""Table `usage_daily`: requests, tokens and errors per day (UTC), key and user.

One row per (day, key_id, user_id); each process adds its counts in batches
(`proxy/access/usage.py` flushes every MEMPROXY_USAGE_FLUSH_SECONDS), so replicas add to
the same rows: an upsert that sums, never a read-modify-write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from memory.storage.database import Connection, Transaction, equal_to, marks

COUNTERS = ("requests", "input_tokens", "output_tokens", "memory_tokens", "errors")


@dataclass(frozen=True, slots=True)
class UsageCounts:
    """What a (day, key, user) row holds, or a sum of rows."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    memory_tokens: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One day's counts of one key and user."""

    day: str  # YYYY-MM-DD (UTC)
    key_id: str
    user_id: str
    counts: UsageCounts


_ADD = (
    "INSERT INTO usage_daily (day, key_id, user_id, requests, input_tokens, output_tokens,"
    " memory_tokens, errors) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (day, key_id, user_id) DO UPDATE SET"
    + ",".join(f" {c} = usage_daily.{c} + excluded.{c}" for c in COUNTERS)
)


async def add(tx: Transaction, rows: Sequence[UsageRow]) -> None:
    """Add each row's counts to its stored row (created at zero)."""
    # One order for every process, so two replicas' batches never lock rows in opposite
    # orders (a deadlock on PostgreSQL).
    ordered = sorted(rows, key=lambda r: (r.day, r.key_id, r.user_id))
    await tx.change_many(_ADD, [
        (r.day, r.key_id, r.user_id, *(getattr(r.counts, c) for c in COUNTERS)) for r in ordered
    ])


def _where(first_day: str, last_day: str, key_id: str | None, user_id: str | None
           ) -> tuple[str, list[Any]]:
    scope, params = equal_to(key_id=key_id, user_id=user_id)
    return f"day >= ? AND day <= ? AND {scope}", [first_day, last_day, *params]


async def rows(
    conn: Connection, first_day: str, last_day: str, *, key_id: str | None = None,
    user_id: str | None = None, limit: int = 1000,
) -> list[UsageRow]:
    """Rows of the days [first_day, last_day], by day, key and user; at most `limit`."""
    where, params = _where(first_day, last_day, key_id, user_id)
    found = await conn.fetch(
        f"SELECT day, key_id, user_id, {', '.join(COUNTERS)} FROM usage_daily WHERE {where}"
        " ORDER BY day, key_id, user_id LIMIT ?", (*params, limit),
    )
    return [UsageRow(str(r[0]), str(r[1]), str(r[2]), UsageCounts(*(int(v) for v in r[3:])))
            for r in found]


async def totals(
    conn: Connection, first_day: str, last_day: str, *, group: str | None,
    key_id: str | None = None, user_id: str | None = None, limit: int = 1000,
) -> list[tuple[str, UsageCounts]]:
    """Sums over the days, per key (`group` "key_id"), per user ("user_id") or all (None:
    one row named "")."""
    if group not in (None, "key_id", "user_id"):
        raise ValueError(f"cannot group usage by {group!r}")
    where, params = _where(first_day, last_day, key_id, user_id)
    sums = ", ".join(f"COALESCE(SUM({c}), 0)" for c in COUNTERS)
    if group is None:
        found = await conn.fetch(f"SELECT '', {sums} FROM usage_daily WHERE {where}", params)
    else:
        found = await conn.fetch(
            f"SELECT {group}, {sums} FROM usage_daily WHERE {where} GROUP BY {group}"
            f" ORDER BY {group} LIMIT ?", (*params, limit),
        )
    return [(str(r[0]), UsageCounts(*(int(v) for v in r[1:]))) for r in found]


async def tokens_since(conn: Connection, key_ids: Sequence[str], first_day: str) -> dict[str, int]:
    """{key_id: input + output tokens from `first_day` on} (a quota's month so far)."""
    if not key_ids:
        return {}
    found = await conn.fetch(
        "SELECT key_id, COALESCE(SUM(input_tokens + output_tokens), 0) FROM usage_daily"
        f" WHERE key_id IN ({marks(len(key_ids))}) AND day >= ? GROUP BY key_id",
        (*key_ids, first_day),
    )
    return dict.fromkeys(key_ids, 0) | {str(r[0]): int(r[1]) for r in found}
