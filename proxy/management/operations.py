"""Each route of the memory and admin APIs is declared once, on its handler: method, path,
summary, answer, errors, body and query (docs/memory-api.md, docs/keys.md, docs/usage.md).

The router (`router`, mounted by proxy/app.py) serves the declarations and the OpenAPI
document (proxy/management/openapi.py) is made from the same ones, so no route is served
undescribed. A handler module's declared operations are its routes (`declared`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from proxy.management.access import Endpoint, endpoint
from proxy.management.bodies import Body, Query

JSON = "application/json"
NDJSON = "application/x-ndjson"
# Every method a route that answers them all takes (so none reaches the pass-through).
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
H = TypeVar("H")


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


def declare(guard: Callable[[H], Endpoint], route: str, summary: str, ok: str | dict[str, Any],
            *errors: str, **more: Any) -> Callable[[H], Operation]:
    """Declare a handler as the operation `route` ("METHOD /path"), served behind `guard`."""
    method, path = route.split(" ")

    def declared(handler: H) -> Operation:
        return Operation(method, path, guard(handler), summary, ok, errors, **more)

    return declared


# A memory API operation: its caller authorised first (proxy/management/access.py).
memory = functools.partial(declare, endpoint)


def declared(*modules: ModuleType) -> list[Operation]:
    """The operations the modules declare, in the order they declare them."""
    return [value for module in modules for value in vars(module).values()
            if isinstance(value, Operation)]


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
