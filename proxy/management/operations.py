"""Every route of the memory and admin APIs, declared once: method, path, handler, summary,
body, query and answer (docs/memory-api.md, docs/keys.md, docs/usage.md).

The router (`router`, mounted by proxy/app.py) serves these tables and the OpenAPI document
(proxy/management/openapi.py) is made from them, so no route is served undescribed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from proxy.management import (
    admin_keys,
    admin_usage,
    clearing,
    facts,
    profile,
    search,
    sessions,
    stats,
    transfer,
)
from proxy.management.access import Endpoint
from proxy.management.bodies import (
    ApiKeyChanges,
    Body,
    ClearRequest,
    ConsentChange,
    FactChanges,
    FactQuery,
    MetricsQuery,
    NewApiKey,
    NewFact,
    ProfileBody,
    Query,
    SearchQuery,
    SessionQuery,
    TurnQuery,
    UndoRequest,
    UsageQuery,
)

JSON = "application/json"
NDJSON = "application/x-ndjson"
# Every method a route that answers them all takes (so none reaches the pass-through).
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@dataclass(frozen=True)
class Operation:
    """One method on one path: what serves it, and what the document says of it."""

    method: str
    path: str  # as Starlette matches it; the document writes `{name:path}` as `{name}`
    endpoint: Endpoint
    summary: str
    ok: str | dict[str, Any]  # the answer's component name, or the whole response object
    errors: tuple[str, ...] = ()  # beyond those every call of its API can answer with
    status: str = "200"
    # a model, or the name of a body the document writes out (proxy/management/openapi.py)
    body: type[Body] | str | None = None
    body_required: bool = True
    query: type[Query] | None = None
    every_method: bool = False  # the endpoint answers other methods itself (its own 405)


def operation(route: str, endpoint: Endpoint, summary: str, ok: str | dict[str, Any],
              *errors: str, **more: Any) -> Operation:
    """An operation from "METHOD /path" and the errors it adds to its API's."""
    method, path = route.split(" ")
    return Operation(method, path, endpoint, summary, ok, errors, **more)


EXPORT_ANSWER = {"description": "meta, turns, facts, summaries, profile: one JSON object per line",
                 "content": {NDJSON: {"schema": {"type": "string"}}}}

MEMORY_API = (
    operation("GET /facts", facts.list_facts, "List facts, newest first", "FactList", "400",
              query=FactQuery),
    operation("POST /facts", facts.add_fact, "Add a fact (manual facts start at confidence 0.6)",
              "Fact", "400", "409", "413", status="201", body=NewFact),
    operation("GET /facts/{fact_id}", facts.get_fact, "Get one fact (any version)", "Fact",
              "404"),
    operation("PATCH /facts/{fact_id}", facts.edit_fact,
              "Edit: a new version; the old one is kept as history (409: an old version)",
              "Fact", "400", "404", "409", "413", body=FactChanges),
    operation("DELETE /facts/{fact_id}", facts.delete_fact,
              "Delete a fact and its history; the undo token restores it within the clear"
              " window", "Deleted", "404"),
    operation("POST /facts/{fact_id}/pin", facts.pin_fact,
              "Pin (never expires, never evicted; 409 at the pin limit)", "Fact", "404", "409"),
    operation("POST /facts/{fact_id}/unpin", facts.unpin_fact, "Unpin", "Fact", "404", "409"),
    operation("GET /facts/{fact_id}/history", facts.fact_history,
              "Every version of a fact, oldest first", "FactList", "404"),
    operation("GET /sessions", sessions.list_sessions, "Sessions, most recently active first",
              "SessionList", "400", query=SessionQuery),
    operation("GET /sessions/{session_id:path}", sessions.get_session,
              "One session with its counts", "Session", "400", "404"),
    operation("DELETE /sessions/{session_id:path}", sessions.delete_session,
              "Delete a session: turns, chunks, vectors, summaries, facts only from it",
              "Deleted", "400", "404"),
    operation("GET /turns", sessions.list_turns, "A session's turns in stored order",
              "TurnList", "400", "404", query=TurnQuery),
    operation("POST /search", search.search,
              "What would be injected for a query (no model is called)", "SearchResult", "400",
              "413", body=SearchQuery),
    operation("POST /clear", clearing.clear_all, "Clear all memory; returns an undo token",
              "Clear", "400", "413", body=ClearRequest, body_required=False),
    operation("POST /clear/undo", clearing.undo_clear,
              "Undo a clear or a fact's deletion within its window (409 after it)",
              "ImportReport", "400", "404", "409", "413", body=UndoRequest),
    operation("GET /export", transfer.export, "Export as JSON Lines (streamed)", EXPORT_ANSWER),
    operation("POST /import", transfer.import_records,
              "Import JSON Lines of records or OpenAI-format conversations (idempotent)",
              "ImportReport", "400", "413", body="records"),
    operation("GET /consent", profile.get_profile, "Consent and profile", "Profile"),
    operation("PUT /consent", profile.put_consent,
              "Give or revoke consent (revoking deletes the profile)", "Profile", "400", "413",
              body=ConsentChange),
    operation("GET /profile", profile.get_profile, "Consent and profile", "Profile"),
    operation("PUT /profile", profile.put_profile, "Write the profile (needs consent)",
              "Profile", "400", "409", "413", body=ProfileBody),
    operation("DELETE /profile", profile.delete_profile, "Delete the profile (consent stays)",
              "Profile"),
    operation("GET /stats", stats.stats, "Counts, index sizes, job queue and dead letters",
              "Stats"),
    operation("GET /metrics", stats.metrics, "Per-request metrics over a time range", "Metrics",
              "400", query=MetricsQuery),
)

ADMIN_API = (
    operation("GET /keys", admin_keys.list_keys, "Every key: MEMPROXY_API_KEYS's (source env)"
              " and the stored ones; never a secret", "ApiKeyList"),
    operation("POST /keys", admin_keys.create_key,
              "Make a key; its secret is in `key`, shown this once", "ApiKeyCreated", "400",
              "413", status="201", body=NewApiKey),
    operation("GET /keys/{key_id}", admin_keys.get_key, "One key", "ApiKey", "404"),
    operation("PATCH /keys/{key_id}", admin_keys.change_key,
              "Change expires_at, rate_limit, token_quota or org_writer (null clears)",
              "ApiKey", "400", "404", "409", "413", body=ApiKeyChanges),
    operation("DELETE /keys/{key_id}", admin_keys.revoke_key,
              "Revoke a key (409: already revoked)", "ApiKey", "404", "409"),
    operation("GET /usage", admin_usage.usage,
              "Usage per day (UTC), key and user, with sums per key, per user and in all",
              "UsageReport", "400", "405", query=UsageQuery, every_method=True),
)


def router(table: Sequence[Operation]) -> list[BaseRoute]:
    """One route per path, in the table's order: a 405 then lists every method it allows."""
    paths: dict[str, list[Operation]] = {}
    for op in table:
        paths.setdefault(op.path, []).append(op)
    return [_route(path, ops) for path, ops in paths.items()]


def _route(path: str, ops: list[Operation]) -> Route:
    handlers = {op.method: op.endpoint for op in ops}

    async def dispatch(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        # On a path that takes every method, its one endpoint refuses the others itself.
        return await handlers.get(method, ops[0].endpoint)(request)

    every = any(op.every_method for op in ops)
    return Route(path, dispatch, methods=METHODS if every else list(handlers))
