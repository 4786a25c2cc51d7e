"""Reading management request bodies and query strings: typed, bounded, 400 naming the field.

Bodies and query strings are declared once in proxy/management/bodies.py."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from proxy.http.body import read_body
from proxy.http.errors import InvalidRequest, NotFound
from proxy.management.bodies import B, Q, parse

# How deep a management body may nest. Nothing the API takes needs more than a few levels;
# the JSON reader accepts 1024 and the writer 254, so a deeper profile stored was a 500.
MAX_DEPTH = 32


async def json_body(request: Request, limit: int, model: type[B], *, empty_ok: bool = False) -> B:
    """The body as `model` declares it (proxy/management/bodies.py): 400 naming the field."""
    raw = await read_body(request, limit)
    if not raw and empty_ok:  # no body at all; whitespace is not JSON
        return parse(model, {})
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("the body must be valid JSON") from None
    if nested_too_deep(body):
        raise InvalidRequest(f"the body nests deeper than {MAX_DEPTH} levels")
    return parse(model, body)


def nested_too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` has objects or arrays nested more than `limit` levels deep."""
    level: list[Any] = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        if not level:
            return False
        level = [
            child for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
    return bool(level)


def query(request: Request, model: type[Q]) -> Q:
    """The query string as `model` declares it (proxy/management/bodies.py): 400 naming
    the parameter."""
    return parse(model, dict(request.query_params), noun="query parameter")


def digits_cursor(cursor: str | None) -> str | None:
    """A cursor that is a row number (facts, turns), or none: the first page."""
    if cursor is not None and not (cursor.isascii() and cursor.isdigit()):
        raise InvalidRequest("invalid cursor", param="cursor")
    return cursor


def path_id(request: Request, name: str) -> int:
    """An integer id from the path; 404 wording when it cannot be one."""
    raw = request.path_params[name]
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise NotFound(f"no {name.removesuffix('_id')} {raw!r}", param=name)
    return int(raw)
