"""Reading management request bodies and query strings: typed, bounded, 400 naming the field.

Bodies are declared once in proxy/management/bodies.py; the query parameters are read here."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import orjson
from starlette.requests import Request

from proxy.http.body import read_body
from proxy.http.errors import InvalidRequest, NotFound
from proxy.management.bodies import B, parse

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


def query_limit(request: Request, default: int, maximum: int) -> int:
    """The `limit` query parameter: 1 to `maximum`."""
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= maximum:
        raise InvalidRequest(f"limit must be an integer from 1 to {maximum}", param="limit")
    return int(raw)


def query_flag(request: Request, name: str) -> bool | None:
    """A true/false query parameter, or None when absent."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    value = {"true": True, "1": True, "false": False, "0": False}.get(raw.lower())
    if value is None:
        raise InvalidRequest(f"{name} must be true or false", param=name)
    return value


def query_time(request: Request, name: str, default: float) -> float:
    """A unix-seconds query parameter."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(f"{name} must be a time in unix seconds", param=name)
    return value


def query_choice(request: Request, name: str, choices: Collection[str]) -> str | None:
    """A query parameter holding one of `choices`, or None when absent."""
    raw = request.query_params.get(name)
    if raw is not None and raw not in choices:
        raise InvalidRequest(f"{name} must be one of {', '.join(choices)}", param=name)
    return raw


def query_text(request: Request, name: str, *, max_chars: int = 1000) -> str | None:
    """A free-text query parameter (empty counts as absent)."""
    raw = request.query_params.get(name)
    if raw is None or not raw.strip():
        return None
    if len(raw) > max_chars:
        raise InvalidRequest(f"{name} must be at most {max_chars} characters", param=name)
    return raw.strip()


def path_id(request: Request, name: str) -> int:
    """An integer id from the path; 404 wording when it cannot be one."""
    raw = request.path_params[name]
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise NotFound(f"no {name.removesuffix('_id')} {raw!r}", param=name)
    return int(raw)
