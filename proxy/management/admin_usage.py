"""GET /v1/admin/usage: requests, tokens and errors per day (UTC), key and user, with their
sums per key, per user and in all (docs/usage.md). The admin key only (`require_admin`)."""

from __future__ import annotations

import datetime
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from memory import UsageCounts
from proxy.access.decision import require_admin
from proxy.http.errors import InvalidRequest, MemoryUnavailable, MethodNotAllowed
from proxy.management.access import respond
from proxy.management.bodies import UsageQuery
from proxy.management.inputs import query
from proxy.management.operations import declare
from proxy.state import AppState

MAX_DAYS = 366  # the longest range one call reports


# Served as it is: it checks the method and the admin key itself.
@declare(lambda endpoint: endpoint, "GET /usage",
         "Usage per day (UTC), key and user, with sums per key, per user and in all",
         "UsageReport", "400", "405", query=UsageQuery, every_method=True)
async def usage(request: Request) -> Response:
    """GET /v1/admin/usage?from=&to=&key_id=&user=&limit="""
    state: AppState = request.app.state.memproxy
    if request.method not in ("GET", "HEAD"):
        raise MethodNotAllowed(f"{request.method} is not allowed on /v1/admin/usage; use GET",
                               headers={"Allow": "GET, HEAD"})
    await require_admin(request, state.settings, state.keys)
    if state.usage is None or state.memory is None:
        raise MemoryUnavailable("usage is kept in the memory database, which this proxy runs without")
    for name in request.query_params:
        if len(request.query_params.getlist(name)) > 1:
            raise InvalidRequest(f"{name} is given more than once", param=name)
    asked = query(request, UsageQuery)
    today = datetime.datetime.fromtimestamp(time.time(), datetime.UTC).date()
    last = asked.to or today
    first = asked.start or last.replace(day=1)
    if first > last:
        raise InvalidRequest("from must not be after to", param="from")
    if (last - first).days >= MAX_DAYS:
        raise InvalidRequest(f"a report covers at most {MAX_DAYS} days", param="from")
    key_id, user, limit = asked.key_id, asked.user, asked.limit
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
