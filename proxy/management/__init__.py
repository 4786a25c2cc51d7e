"""The memory management API under /v1/memory (docs/memory-api.md), one module per resource.

    facts.py     facts: list, get, add, edit, delete, pin, history
    sessions.py  sessions and their turns
    search.py    what would be injected for a query
    clearing.py  clear all, undo
    transfer.py  export, import
    profile.py   consent and profile
    stats.py     counts, index sizes, jobs; request metrics
    openapi.py   the OpenAPI document of all of the above (and of the admin API)
    bodies.py    every request body, declared once: validation and the document's schemas
    answers.py   every answer, declared once: the document's answer schemas

The admin API under /v1/admin (the admin key only) sits beside it, mounted by proxy/app.py:

    admin_keys.py     proxy keys in the database (docs/keys.md)
    admin_usage.py    usage per day, key and user (docs/usage.md)
    openapi_admin.py  its part of the OpenAPI document
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from proxy.management import clearing, facts, profile, search, sessions, stats, transfer
from proxy.management.openapi import openapi

Endpoint = Callable[[Request], Awaitable[Response]]


def routes() -> list[BaseRoute]:
    """The routes, relative to /v1/memory."""
    return [
        _route("/openapi.json", GET=openapi),
        _route("/facts", GET=facts.list_facts, POST=facts.add_fact),
        _route("/facts/{fact_id}", GET=facts.get_fact, PATCH=facts.edit_fact,
               DELETE=facts.delete_fact),
        _route("/facts/{fact_id}/pin", POST=facts.pin_fact),
        _route("/facts/{fact_id}/unpin", POST=facts.unpin_fact),
        _route("/facts/{fact_id}/history", GET=facts.fact_history),
        _route("/sessions", GET=sessions.list_sessions),
        _route("/sessions/{session_id:path}", GET=sessions.get_session,
               DELETE=sessions.delete_session),
        _route("/turns", GET=sessions.list_turns),
        _route("/search", POST=search.search),
        _route("/clear", POST=clearing.clear_all),
        _route("/clear/undo", POST=clearing.undo_clear),
        _route("/export", GET=transfer.export),
        _route("/import", POST=transfer.import_records),
        _route("/consent", GET=profile.get_profile, PUT=profile.put_consent),
        _route("/profile", GET=profile.get_profile, PUT=profile.put_profile,
               DELETE=profile.delete_profile),
        _route("/stats", GET=stats.stats),
        _route("/metrics", GET=stats.metrics),
    ]


def _route(path: str, **handlers: Endpoint) -> Route:
    """One route per path: a 405 then lists every method the path allows."""

    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await handlers[method](request)

    return Route(path, dispatch, methods=list(handlers))
