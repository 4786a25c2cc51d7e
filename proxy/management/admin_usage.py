"""GET /v1/admin/usage: requests, tokens and errors per day (UTC), key and user, with their
sums per key, per user and in all (docs/usage.md). The admin key only (`require_admin`)."""

from __future__ import annotations

import datetime
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from memory import UsageCounts
from proxy.access.decision import require_admin
from proxy.access.identity import MAX_ID_LENGTH
from proxy.http.errors import InvalidRequest, MemoryUnavailable, MethodNotAllowed
from proxy.management.access import respond
from proxy.management.inputs import query_limit
from proxy.state import AppState

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
PARAMS = frozenset({"from", "to", "key_id", "user", "limit"})
MAX_DAYS = 366  # the longest range one call reports
MAX_ROWS = 10_000
MAX_KEY_ID = 200
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")  # what fromisoformat takes besides (weeks, ...) is not


def admin_usage_routes() -> list[BaseRoute]:
    """The usage half of the admin API, relative to /v1/admin (proxy/app.py mounts it
    before the pass-through)."""
    # Every method: another one gets 405 here instead of the pass-through's forwarding.
    return [Route("/usage", usage, methods=METHODS)]


async def usage(request: Request) -> Response:
    """GET /v1/admin/usage?from=&to=&key_id=&user=&limit="""
    state: AppState = request.app.state.memproxy
    if request.method not in ("GET", "HEAD"):
        raise MethodNotAllowed(f"{request.method} is not allowed on /v1/admin/usage; use GET",
                               headers={"Allow": "GET, HEAD"})
    await require_admin(request, state.settings, state.keys)
    if state.usage is None or state.memory is None:
        raise MemoryUnavailable("usage is kept in the memory database, which this proxy runs without")
    for name, _ in request.query_params.multi_items():
        if name not in PARAMS:
            raise InvalidRequest(f"unknown query parameter {name!r}; usage takes"
                                 f" {', '.join(sorted(PARAMS))}", param=name)
        if len(request.query_params.getlist(name)) > 1:
            raise InvalidRequest(f"{name} is given more than once", param=name)
    today = datetime.datetime.fromtimestamp(time.time(), datetime.UTC).date()
    last = _day(request, "to") or today
    first = _day(request, "from") or last.replace(day=1)
    if first > last:
        raise InvalidRequest("from must not be after to", param="from")
    if (last - first).days >= MAX_DAYS:
        raise InvalidRequest(f"a report covers at most {MAX_DAYS} days", param="from")
    key_id = _text(request, "key_id", MAX_KEY_ID)
    user = _text(request, "user", MAX_ID_LENGTH)
    limit = query_limit(request, 1000, MAX_ROWS)
    await state.usage.flush()  # this process's counts so far are in the report
    report = await state.memory.usage.report(
        first.isoformat(), last.isoformat(), key_id=key_id, user_id=user, limit=limit,
    )
    return respond({
        "object": "usage.report", "from": first.isoformat(), "to": last.isoformat(),
        "key_id": key_id, "user": user,
        "data": [{"day": r.day, "key_id": r.key_id, "user_id": r.user_id, **r.counts.as_dict()}
                 for r in report.rows],
        "has_more": report.has_more,
        "by_key": [_named("key_id", name, counts) for name, counts in report.by_key],
        "by_user": [_named("user_id", name, counts) for name, counts in report.by_user],
        "totals": report.totals.as_dict(),
    })


def _named(field: str, name: str, counts: UsageCounts) -> dict[str, Any]:
    return {field: name, **counts.as_dict()}


def _day(request: Request, name: str) -> datetime.date | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        if not _DAY.fullmatch(raw):
            raise ValueError(raw)
        return datetime.date.fromisoformat(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be a day as YYYY-MM-DD", param=name) from None


def _text(request: Request, name: str, max_chars: int) -> str | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not 1 <= len(raw) <= max_chars or not raw.isprintable():
        raise InvalidRequest(f"{name} must be 1 to {max_chars} printable characters", param=name)
    return raw
