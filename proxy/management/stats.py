"""Stats (counts, index sizes, job queue) and per-request metrics over a time range."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from memory import CATEGORIES
from proxy.management.access import Caller, page, respond
from proxy.management.bodies import MetricsQuery
from proxy.management.inputs import query
from proxy.management.operations import memory

DAY = 86400.0


@memory("GET /stats", "Counts, index sizes, job queue and dead letters", "Stats")
async def stats(request: Request, who: Caller) -> Response:
    """GET /v1/memory/stats"""
    manage = who.memory.manage
    settings = who.settings
    found = await manage.stats.user(who.user_id)
    if (settings.keys_required or settings.admin_key or who.principal.key is not None) \
            and not who.principal.admin:
        # Where keys separate users, a key sees its own memory's figures only: the job
        # queue, the database and the vector index are everyone's (a dead letter's error
        # may quote any user's data), so their figures go to the admin.
        found["index"] = {"vectors": found["index"]["vectors"]}
        found["jobs"] = None
    return respond({
        "object": "memory.stats",
        **found,
        "pending_clears": await manage.clears.pending(who.user_id),
        "limits": {
            "memory_budget": settings.memory_budget, "memory_scope": settings.memory_scope,
            "clear_undo_seconds": settings.clear_undo_seconds,
            "fact_max_pinned": settings.fact_max_pinned, "categories": list(CATEGORIES),
        },
    })


@memory("GET /metrics", "Per-request metrics over a time range", "Metrics", "400",
        query=MetricsQuery)
async def metrics(request: Request, who: Caller) -> Response:
    """GET /v1/memory/metrics?since=&until=&limit=&cursor=: a cursor page of the user's
    request metrics, oldest first, with a summary of the whole range."""
    now = time.time()
    asked = query(request, MetricsQuery)
    until = now + 1 if asked.until is None else asked.until
    since = until - DAY if asked.since is None else asked.since
    # since after until is an empty range, not an error.
    stats = who.memory.manage.stats
    rows, cursor = await stats.metrics(
        who.user_id, since, until, asked.limit, asked.cursor,
    )
    summary = await stats.metrics_summary(who.user_id, since, until)
    return respond({**page(rows, cursor), "since": since, "until": until, "summary": summary})
