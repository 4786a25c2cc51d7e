"""The memory management API under /v1/memory (docs/memory-api.md), one module per resource.

    facts.py       facts: list, get, add, edit, delete, pin, history
    sessions.py    sessions and their turns
    search.py      what would be injected for a query
    clearing.py    clear all, undo
    transfer.py    export, import
    profile.py     consent and profile
    stats.py       counts, index sizes, jobs; request metrics
    operations.py  how a route is declared, once, on its handler: what the router serves
                   and the OpenAPI document's paths describe (table.py lists them)
    openapi.py     the OpenAPI document of both
    bodies.py      every request body, declared once: validation and the document's schemas
    answers.py     every answer, declared once: the document's answer schemas

The admin API under /v1/admin (the admin key only) sits beside it, mounted by proxy/app.py:

    admin_keys.py     proxy keys in the database (docs/keys.md)
    admin_usage.py    usage per day, key and user (docs/usage.md)
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from proxy.management.openapi import openapi
from proxy.management.operations import router
from proxy.management.table import ADMIN_API, MEMORY_API


def routes() -> list[BaseRoute]:
    """The routes, relative to /v1/memory."""
    return [Route("/openapi.json", openapi, methods=["GET"]), *router(MEMORY_API)]


def admin_routes() -> list[BaseRoute]:
    """The admin API's routes, relative to /v1/admin."""
    return router(ADMIN_API)
