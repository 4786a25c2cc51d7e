"""The OpenAPI 3.0 document of the memory API, served at /v1/memory/openapi.json.

It is made from the declarations: the paths from the routes' (proxy/management/
operations.py; the router serves the same ones), the schemas from the request bodies
(proxy/management/bodies.py, which also validates them), the answers (answers.py) and the
import records (memory/admin/record_checks.py, which also checks them). Tests check every route is described, every route that
takes a body declares it, and every answer matches its schema.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from memory import RECORD_SHAPES
from proxy.access.identity import MAX_ID_LENGTH
from proxy.management.access import respond
from proxy.management.answers import ANSWERS
from proxy.management.bodies import BODIES, openapi_schema, parameters
from proxy.management.operations import JSON, NDJSON, Operation
from proxy.management.table import ADMIN_API, MEMORY_API

USER_ID = {"$ref": "#/components/parameters/UserId"}
PATH_PARAMETERS = {
    "fact_id": {"type": "integer", "minimum": 0},
    "session_id": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH},
    "key_id": {"type": "string", "minLength": 1, "maxLength": 100},
}
# The bodies that are not one JSON object of a model, by the name their operation gives.
WRITTEN_BODIES = {"records": {
    "required": True, "content": {
        JSON: {"schema": {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"$ref": f"#/components/schemas/{name}"} for name in RECORD_SHAPES]}}},
        NDJSON: {"schema": {"type": "string"}},
    }, "description": "A JSON array of records, or JSON Lines: one record (as in the array)"
                      " per line.",
}}


@dataclass(frozen=True)
class Api:
    """What every operation of one API shares in the document."""

    always: tuple[str, ...]  # the errors any of its calls can answer with
    texts: dict[str, str]  # what each error means in this API
    headers: tuple[dict[str, Any], ...] = ()  # parameters before a query's
    servers: tuple[dict[str, str], ...] = ()  # the API's own, when it is not /v1/memory
    more: tuple[tuple[str, Any], ...] = ()  # more fields of each operation


# A bad X-Memory-User-Id, no or a wrong key, a key for another user or a remote client
# without keys, memory turned off.
MEMORY = Api(("400", "401", "403", "500", "503"), {
    "400": "Invalid input; `param` names the field.",
    "401": "Proxy keys are on and the key is missing or wrong.",
    "403": "The key is bound to another user, or a remote client without keys.",
    "404": "No such item for this user.",
    "409": "Conflict with the current state: a profile without consent, an old fact version,"
           " the pin limit, an undo after its window.",
    "413": "The body is larger than MEMPROXY_MAX_BODY_BYTES.",
    "500": "A bug in memproxy.",
    "503": "Memory is turned off on this proxy.",
}, headers=(USER_ID,))
# The admin API's paths (tag `admin`, the admin key only) carry their own server, /v1/admin.
ADMIN = Api(("401", "403", "500", "503"), {
    "400": "Invalid input; `param` names the field. Nothing was changed.",
    "401": "No key, or a wrong one.",
    "403": "A valid key that is not the admin key, or no admin key is configured.",
    "404": "No key with this id.",
    "405": "A method other than GET.",
    "409": "The key is revoked, or comes from MEMPROXY_API_KEYS (read-only here).",
    "413": "The body is larger than MEMPROXY_MAX_BODY_BYTES.",
    "500": "A bug in memproxy.",
    "503": "Memory, and so the key database, is off on this proxy; or it is unreachable.",
}, servers=({"url": "/v1/admin"},), more=(("tags", ["admin"]), ("security", [{"bearer": []}])))


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def answer(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def paths(table: Sequence[Operation], api: Api) -> dict[str, Any]:
    """The document's path items of a route table."""
    items: dict[str, Any] = {}
    for op in table:
        path = re.sub(r"\{(\w+):path\}", r"{\1}", op.path)
        if path not in items:
            names = re.findall(r"\{(\w+)\}", path)
            items[path] = {
                **({"servers": list(api.servers)} if api.servers else {}),
                **({"parameters": [_path_parameter(name) for name in names]} if names else {}),
            }
        items[path][op.method.lower()] = _operation(op, api)
    return items


def _path_parameter(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": PATH_PARAMETERS[name]}


def _operation(op: Operation, api: Api) -> dict[str, Any]:
    """One operation: its answer, then each error it can give with what it means here."""
    ok = answer(ref(op.ok)) if isinstance(op.ok, str) else op.ok
    errors = {code: answer(ref("Error"), api.texts[code])
              for code in sorted({*op.errors, *api.always})}
    done: dict[str, Any] = {"summary": op.summary, "responses": {op.status: ok, **errors},
                            **dict(api.more)}
    query = [] if op.query is None else parameters(op.query)
    if api.headers or query:
        done["parameters"] = [*api.headers, *query]
    if isinstance(op.body, str):
        done["requestBody"] = WRITTEN_BODIES[op.body]
    elif op.body is not None:
        done["requestBody"] = {"required": op.body_required,
                               "content": {JSON: {"schema": ref(op.body.__name__)}}}
    return done


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
                    **{model.__name__: openapi_schema(model) for model in BODIES}},
    },
    "paths": {**paths(MEMORY_API, MEMORY), **paths(ADMIN_API, ADMIN)},
}


async def openapi(request: Request) -> Response:
    """GET /v1/memory/openapi.json (no key needed: it describes, it holds no data)."""
    return respond(DOCUMENT)
