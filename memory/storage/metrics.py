"""Table `request_metrics`: one row per proxied request, kept for a retention period."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memory.storage.database import Connection, Transaction

_FIELDS = (
    "created_at", "session_id", "request_id", "model", "items", "injected_tokens", "truncated",
    "recall_ms", "embed_ms", "error",
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
        "INSERT INTO request_metrics (created_at, user_id, session_id, request_id, model,"
        " items_json, injected_tokens, truncated, recall_ms, embed_ms, error)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            row.created_at, row.user_id, row.session_id, row.request_id, row.model,
            json.dumps(dict(row.items), sort_keys=True), row.injected_tokens,
            int(row.truncated), row.recall_ms, row.embed_ms, row.error,
        ),
    )  # fmt: skip


async def prune(tx: Transaction, older_than: float) -> int:
    """Delete rows created before `older_than`; return how many."""
    return await tx.change("DELETE FROM request_metrics WHERE created_at < ?", (older_than,))


async def page(
    conn: Connection, user_id: str, since: float, until: float, limit: int
) -> list[dict[str, Any]]:
    """Up to `limit` of the user's rows in [since, until), oldest first, as dicts."""
    rows = await conn.fetch(
        "SELECT created_at, session_id, request_id, model, items_json, injected_tokens,"
        " truncated, recall_ms, embed_ms, error FROM request_metrics"
        " WHERE user_id = ? AND created_at >= ? AND created_at < ?"
        " ORDER BY created_at, id LIMIT ?",
        (user_id, since, until, limit),
    )
    found = []
    for row in rows:
        item = dict(zip(_FIELDS, row, strict=True))
        item["items"] = json.loads(item["items"])
        item["truncated"] = bool(item["truncated"])
        found.append(item)
    return found


# What a metrics row holds besides its user: take_rows returns rows with these keys.
ROW_FIELDS = (
    "created_at", "session_id", "request_id", "model", "items_json", "injected_tokens",
    "truncated", "recall_ms", "embed_ms", "error",
)


async def take_rows(
    tx: Transaction, user_id: str, session_id: str | None = None
) -> list[dict[str, Any]]:
    """Delete the user's metrics rows (or one session's) in `tx`; return them, oldest first."""
    scope, params = ("", (user_id,)) if session_id is None else (
        " AND session_id = ?", (user_id, session_id))
    rows = await tx.fetch(
        f"DELETE FROM request_metrics WHERE user_id = ?{scope}"
        f" RETURNING id, {', '.join(ROW_FIELDS)}", params,
    )
    rows.sort(key=lambda row: int(row[0]))
    return [dict(zip(ROW_FIELDS, row[1:], strict=True)) for row in rows]


async def put_rows(tx: Transaction, user_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert rows take_rows returned, for `user_id` (undoing a clear)."""
    if rows and tx.dialect == "postgres":
        await tx.change_many(
            f"INSERT INTO request_metrics (user_id, {', '.join(ROW_FIELDS)})"
            f" VALUES (?, {', '.join('?' * len(ROW_FIELDS))})",
            [(user_id, *(row[f] for f in ROW_FIELDS)) for row in rows],
        )
    elif rows:
        await tx.change(
            f"INSERT INTO request_metrics (user_id, {', '.join(ROW_FIELDS)})"
            f" SELECT ?, {', '.join(f'value ->> {f!r}' for f in ROW_FIELDS)}"
            " FROM json_each(?) ORDER BY key",
            (user_id, json.dumps([dict(row) for row in rows])),
        )
