"""Table `request_metrics`: one row per proxied request, kept for a retention period."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memory.storage.database import Connection, Transaction, equal_to, marks

# What a metrics row holds besides its user: take_rows returns rows with these keys.
ROW_FIELDS = (
    "created_at", "session_id", "request_id", "model", "items_json", "injected_tokens",
    "truncated", "recall_ms", "embed_ms", "error",
)
_FIELDS = tuple(name.removesuffix("_json") for name in ROW_FIELDS)  # as page() shows them
_INSERT = (
    f"INSERT INTO request_metrics (user_id, {', '.join(ROW_FIELDS)})"
    f" VALUES (?, {marks(len(ROW_FIELDS))})"
)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One row per proxied request; `items` counts recalled items by source."""

    user_id: str
    session_id: str | None = None
    request_id: str | None = None
    model: str | None = None
    items: Mapping[str, int] = field(default_factory=dict)
    injected_tokens: int = 0
    truncated: bool = False
    recall_ms: float | None = None
    embed_ms: float | None = None
    error: str | None = None
    created_at: float = field(default_factory=time.time)


async def insert(tx: Transaction, row: RequestMetrics) -> None:
    """Store one request's memory metrics."""
    await tx.change(
        _INSERT,
        (
            row.user_id, row.created_at, row.session_id, row.request_id, row.model,
            json.dumps(dict(row.items), sort_keys=True), row.injected_tokens,
            int(row.truncated), row.recall_ms, row.embed_ms, row.error,
        ),
    )  # fmt: skip


async def prune(tx: Transaction, older_than: float) -> int:
    """Delete rows created before `older_than`; return how many."""
    return await tx.change("DELETE FROM request_metrics WHERE created_at < ?", (older_than,))


_RANGE = "user_id = ? AND created_at >= ? AND created_at < ?"


async def page(
    conn: Connection, user_id: str, since: float, until: float, limit: int,
    after: tuple[float, int] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """Up to `limit` of the user's rows in [since, until), oldest first, after the row
    `after` (its created_at and id): (id, row as a dict) pairs."""
    params: tuple[Any, ...] = (user_id, since, until)
    later = ""
    if after is not None:
        later = " AND (created_at > ? OR (created_at = ? AND id > ?))"
        params += (after[0], after[0], after[1])
    rows = await conn.fetch(
        f"SELECT id, {', '.join(ROW_FIELDS)} FROM request_metrics WHERE {_RANGE}{later}"
        " ORDER BY created_at, id LIMIT ?",
        (*params, limit),
    )
    return [(int(row[0]), _shown(row[1:])) for row in rows]


def _shown(values: Sequence[Any]) -> dict[str, Any]:
    item = dict(zip(_FIELDS, values, strict=True))
    return item | {"items": json.loads(item["items"]), "truncated": bool(item["truncated"])}


@dataclass(frozen=True)
class RangeTotals:
    """Aggregates of the user's rows in a time range (all of them, not one page)."""

    requests: int
    latencies: int  # rows with a recall latency
    recall_ms_max: float | None
    injected_tokens_mean: float | None
    injected_tokens_max: int | None
    truncated: int
    errors: int


async def totals(conn: Connection, user_id: str, since: float, until: float) -> RangeTotals:
    """Counts, maxima and the mean of injected tokens over the range, in one query."""
    row = (await conn.fetch(
        "SELECT COUNT(*), COUNT(recall_ms), MAX(recall_ms), AVG(injected_tokens),"
        " MAX(injected_tokens), COALESCE(SUM(CASE WHEN truncated <> 0 THEN 1 ELSE 0 END), 0),"
        " COALESCE(SUM(CASE WHEN error IS NOT NULL AND error <> '' THEN 1 ELSE 0 END), 0)"
        f" FROM request_metrics WHERE {_RANGE}",
        (user_id, since, until),
    ))[0]
    return RangeTotals(
        int(row[0]), int(row[1]), None if row[2] is None else float(row[2]),
        None if row[3] is None else float(row[3]), None if row[4] is None else int(row[4]),
        int(row[5]), int(row[6]),
    )


async def latency_at(
    conn: Connection, user_id: str, since: float, until: float, index: int
) -> float | None:
    """The range's recall latency at `index` in ascending order (for percentiles)."""
    rows = await conn.fetch(
        f"SELECT recall_ms FROM request_metrics WHERE {_RANGE} AND recall_ms IS NOT NULL"
        " ORDER BY recall_ms LIMIT 1 OFFSET ?",
        (user_id, since, until, index),
    )
    return float(rows[0][0]) if rows else None


async def take_rows(
    tx: Transaction, user_id: str, session_id: str | None = None
) -> list[dict[str, Any]]:
    """Delete the user's metrics rows (or one session's) in `tx`; return them, oldest first."""
    where, params = equal_to(user_id=user_id, session_id=session_id)
    rows = await tx.fetch(
        f"DELETE FROM request_metrics WHERE {where} RETURNING id, {', '.join(ROW_FIELDS)}", params
    )
    rows.sort(key=lambda row: int(row[0]))
    return [dict(zip(ROW_FIELDS, row[1:], strict=True)) for row in rows]


async def put_rows(tx: Transaction, user_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert rows take_rows returned, for `user_id` (undoing a clear)."""
    if rows:
        await tx.change_many(_INSERT, [(user_id, *(row[f] for f in ROW_FIELDS)) for row in rows])
