"""The OpenAPI 3.0 document of the memory API, served at /v1/memory/openapi.json.

Its schemas are made from the declared shapes: the request bodies (proxy/management/bodies.py,
which also validates them), the answers (answers.py) and the import records
(memory/admin/record_checks.py, which also checks them); the paths are written here. Tests
check every route is described, every route that takes a body declares it, and every answer
matches its schema.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from memory import RECORD_SHAPES
from proxy.access.identity import MAX_ID_LENGTH
from proxy.management.access import respond
from proxy.management.answers import ANSWERS
from proxy.management.bodies import (
    FactQuery,
    MetricsQuery,
    SessionQuery,
    TurnQuery,
    openapi_schema,
    openapi_schemas,
    parameters,
)
from proxy.management.openapi_admin import (
    ADMIN_PATHS,
    JSON,
    USAGE_PATHS,
    answer,
    operation,
    ref,
)

NDJSON = "application/x-ndjson"
# Errors any management call can answer with: a bad X-Memory-User-Id, no or a wrong key, a key
# for another user or a remote client without keys, memory turned off.
COMMON_ERRORS = ("400", "401", "403", "500", "503")
_ERROR_TEXT = {
    "400": "Invalid input; `param` names the field.",
    "401": "Proxy keys are on and the key is missing or wrong.",
    "403": "The key is bound to another user, or a remote client without keys.",
    "404": "No such item for this user.",
    "409": "Conflict with the current state: a profile without consent, an old fact version,"
           " the pin limit, an undo after its window.",
    "413": "The body is larger than MEMPROXY_MAX_BODY_BYTES.",
    "500": "A bug in memproxy.",
    "503": "Memory is turned off on this proxy.",
}


def _op(
    summary: str, ok: dict[str, Any], *errors: str, status: str = "200",
    body: dict[str, Any] | None = None, params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return operation(summary, ok, {*errors, *COMMON_ERRORS}, _ERROR_TEXT, status=status,
                     body=body, parameters=[{"$ref": "#/components/parameters/UserId"},
                                            *(params or [])])


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": schema}}}


_FACT_ID = {"name": "fact_id", "in": "path", "required": True,
            "schema": {"type": "integer", "minimum": 0}}
_SESSION_ID = {"name": "session_id", "in": "path", "required": True,
               "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH}}

PATHS: dict[str, Any] = {
    "/facts": {
        "get": _op("List facts, newest first", answer(ref("FactList")), "400",
                   params=parameters(FactQuery)),
        "post": _op("Add a fact (manual facts start at confidence 0.6)", answer(ref("Fact")),
                    "400", "409", "413", status="201", body=_body(ref("NewFact"))),
    },
    "/facts/{fact_id}": {
        "parameters": [_FACT_ID],
        "get": _op("Get one fact (any version)", answer(ref("Fact")), "404"),
        "patch": _op("Edit: a new version; the old one is kept as history (409: an old version)",
                     answer(ref("Fact")), "400", "404", "409", "413",
                     body=_body(ref("FactChanges"))),
        "delete": _op(
            "Delete a fact and its history; the undo token restores it within the clear window",
            answer(ref("Deleted")), "404"),
    },
    "/facts/{fact_id}/pin": {"parameters": [_FACT_ID], "post": _op(
        "Pin (never expires, never evicted; 409 at the pin limit)", answer(ref("Fact")), "404",
        "409")},
    "/facts/{fact_id}/unpin": {"parameters": [_FACT_ID], "post": _op(
        "Unpin", answer(ref("Fact")), "404", "409")},
    "/facts/{fact_id}/history": {"parameters": [_FACT_ID], "get": _op(
        "Every version of a fact, oldest first", answer(ref("FactList")), "404")},
    "/sessions": {"get": _op("Sessions, most recently active first",
                             answer(ref("SessionList")), "400", params=parameters(SessionQuery))},
    "/sessions/{session_id}": {
        "parameters": [_SESSION_ID],
        "get": _op("One session with its counts", answer(ref("Session")), "400", "404"),
        "delete": _op("Delete a session: turns, chunks, vectors, summaries, facts only from it",
                      answer(ref("Deleted")), "400", "404"),
    },
    "/turns": {"get": _op("A session's turns in stored order", answer(ref("TurnList")),
                          "400", "404", params=parameters(TurnQuery))},
    "/search": {"post": _op("What would be injected for a query (no model is called)",
                            answer(ref("SearchResult")), "400", "413",
                            body=_body(ref("SearchQuery")))},
    "/clear": {"post": _op("Clear all memory; returns an undo token", answer(ref("Clear")),
                           "400", "413", body=_body(ref("ClearRequest"), required=False))},
    "/clear/undo": {"post": _op(
        "Undo a clear or a fact's deletion within its window (409 after it)", answer(ref("ImportReport")), "400",
        "404", "409",
        "413", body=_body(ref("UndoRequest")))},
    "/export": {"get": _op("Export as JSON Lines (streamed)", {
        "description": "meta, turns, facts, summaries, profile: one JSON object per line",
        "content": {NDJSON: {"schema": {"type": "string"}}}})},
    "/import": {"post": _op(
        "Import JSON Lines of records or OpenAI-format conversations (idempotent)",
        answer(ref("ImportReport")), "400", "413",
        body={"required": True, "content": {
            JSON: {"schema": {"type": "array", "minItems": 1, "items": {"anyOf": [
                ref(name) for name in RECORD_SHAPES]}}},
            NDJSON: {"schema": {"type": "string"}},
        }, "description": "A JSON array of records, or JSON Lines: one record (as in the"
                          " array) per line."})},
    "/consent": {
        "get": _op("Consent and profile", answer(ref("Profile"))),
        "put": _op("Give or revoke consent (revoking deletes the profile)",
                   answer(ref("Profile")), "400", "413", body=_body(ref("ConsentChange"))),
    },
    "/profile": {
        "get": _op("Consent and profile", answer(ref("Profile"))),
        "put": _op("Write the profile (needs consent)", answer(ref("Profile")), "400", "409",
                   "413", body=_body(ref("ProfileBody"))),
        "delete": _op("Delete the profile (consent stays)", answer(ref("Profile"))),
    },
    "/stats": {"get": _op("Counts, index sizes, job queue and dead letters",
                          answer(ref("Stats")))},
    "/metrics": {"get": _op("Per-request metrics over a time range", answer(ref("Metrics")),
                            "400", params=parameters(MetricsQuery))},
}

DOCUMENT: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {
        "title": "memproxy memory API", "version": "1",
        "description": "See, correct and delete what memproxy remembers. Every call is scoped "
                       "to one user: the key's user, or X-Memory-User-Id. With "
                       "X-Memory-Org-Id, facts, search, export, clear and stats reach the "
                       "organisation's shared memory instead (changes need an org-writer "
                       "key or the admin key). Paths tagged `admin` are the admin API under "
                       "/v1/admin (the admin key only).",
    },
    "servers": [{"url": "/v1/memory"}],
    "security": [{}, {"bearer": []}],
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "parameters": {"UserId": {
            "name": "X-Memory-User-Id", "in": "header", "required": False,
            "description": "Whose memory (admin key or unbound key); a bound key's user only.",
            "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH,
                       "pattern": "^[\\x21-\\x7e]([\\x20-\\x7e]*[\\x21-\\x7e])?$"},
        }},
        "schemas": {**{name: openapi_schema(shape, frozenset(ANSWERS))
                       for name, shape in ANSWERS.items()},
                    **{name: openapi_schema(shape) for name, shape in RECORD_SHAPES.items()},
                    **openapi_schemas()},
    },
    # The admin API's paths (tag `admin`) carry their own server, /v1/admin.
    "paths": {**PATHS, **ADMIN_PATHS, **USAGE_PATHS},
}


async def openapi(request: Request) -> Response:
    """GET /v1/memory/openapi.json (no key needed: it describes, it holds no data)."""
    return respond(DOCUMENT)
