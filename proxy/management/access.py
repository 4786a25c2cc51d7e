"""Who may use the memory API, as which user, and how its failures look on the wire.

With proxy keys on, a key bound to a user reaches that user only; an unbound key names the
user like a chat request does (X-Memory-User-Id, else `default`); the admin key reaches any
user through X-Memory-User-Id. Without keys (local single-user mode) only loopback clients
are served, unless MEMPROXY_MANAGEMENT_REMOTE is on. Requests count against the caller's
key in the same per-key rate limit as chat completions (proxy/limits.py).

With X-Memory-Org-Id a request reaches an organisation's shared memory instead (facts,
search, export and clearing only): any key of that organisation, or one bound to nobody,
reads it; only a key marked `org-writer` for it, the admin key, or a loopback client with
keys off change it. Chat requests never write it.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config import ApiKey, Settings
from memory import (
    ClearExpired,
    ClearNotFound,
    ConsentRequired,
    CursorError,
    FactError,
    FactNotFound,
    MemoryEngine,
    RecordError,
    organization_memory,
)
from proxy.errors import (
    AuthenticationFailed,
    Conflict,
    InvalidRequest,
    MemoryUnavailable,
    NotFound,
    PermissionDenied,
)
from proxy.identity import DEFAULT_USER, authenticate, presented_key, resolve_org, resolve_user
from proxy.limits import limit_key
from proxy.state import AppState


@dataclass(frozen=True)
class Caller:
    """An authorised management request: whose memory it reaches and through what.

    `user_id` is the memory reached: a user's, or an organisation's shared memory (then
    `shared` is true); `org_id` is the organisation whose shared memory recall adds."""

    user_id: str
    admin: bool
    memory: MemoryEngine
    settings: Settings
    state: AppState
    org_id: str | None = None
    shared: bool = False


Handler = Callable[[Request, Caller], Awaitable[Response]]


def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Authorise the request, run the handler, and turn memory errors into API errors."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        who = authorise(request)
        try:
            return await handler(request, who)
        except FactNotFound as exc:
            raise NotFound(str(exc), param=exc.param) from None
        except ConsentRequired as exc:
            raise Conflict(str(exc), param=exc.param, code="consent_required") from None
        except FactError as exc:
            if exc.param == "pinned":  # the pin limit: a state to change, not a bad request
                raise Conflict(str(exc), param="pinned", code="pin_limit") from None
            raise InvalidRequest(str(exc), param=exc.param) from None
        except (CursorError, RecordError) as exc:
            raise InvalidRequest(str(exc), param=getattr(exc, "field", "cursor")) from None
        except ClearNotFound as exc:
            raise NotFound(str(exc), param="undo_token") from None
        except ClearExpired as exc:
            raise Conflict(str(exc), param="undo_token", code="undo_expired") from None

    return run


def authorise(request: Request) -> Caller:
    """The caller of a management request; 401, 403, 429 or 503 when it cannot be served."""
    state: AppState = request.app.state.memproxy
    settings = state.settings
    user_id, admin, key = _user(request, settings)
    org_id = resolve_org(request.headers, None if admin else key)
    shared = "x-memory-org-id" in request.headers
    if shared and org_id is not None:
        _check_shared(request, admin, key, settings)
        user_id = organization_memory(org_id)
    if state.memory is None:
        raise MemoryUnavailable("memory is turned off on this proxy")
    if state.limits.enabled:
        # The bucket chat completions use: the key presented (a proxy key has been checked
        # by now, and the admin key counts as any key does), else the user.
        state.limits.admit(limit_key(None, request.headers, user_id), stream=False)
    return Caller(user_id, admin, state.memory, settings, state, org_id, shared)


# What an organisation's shared memory offers through the API (it has no turns, sessions
# or profile); a path is matched by its first part after /v1/memory/.
SHARED_PATHS = frozenset({"facts", "search", "export", "clear", "stats"})


def _check_shared(request: Request, admin: bool, key: ApiKey | None, settings: Settings) -> None:
    """Refuse a request on an organisation's shared memory that the caller may not make."""
    part = request.url.path.removeprefix("/v1/memory/").split("/", 1)[0]
    if part not in SHARED_PATHS:
        raise InvalidRequest(
            f"/v1/memory/{part} is not available for an organisation's shared memory",
            param="X-Memory-Org-Id",
        )
    reading = request.method in ("GET", "HEAD") or part == "search"
    keys_off = not (settings.api_keys or settings.admin_key)
    if reading or admin or keys_off or (key is not None and key.org_writer):
        return  # resolve_org has checked that a key of an organisation names its own
    raise PermissionDenied(
        "this API key may read but not change the organisation's shared memory",
        param="X-Memory-Org-Id",
    )


def _user(request: Request, settings: Settings) -> tuple[str, bool, ApiKey | None]:
    headers = request.headers
    if settings.api_keys or settings.admin_key:
        presented = presented_key(headers)
        admin_key = settings.admin_key
        if admin_key and presented and hmac.compare_digest(presented.encode(), admin_key.encode()):
            return resolve_user(headers, {}, None), True, None
        if not settings.api_keys:  # only the admin key is configured
            raise AuthenticationFailed(
                "incorrect API key provided" if presented else "missing API key"
            )
        key = authenticate(headers, settings.api_keys)
        return resolve_user(headers, {}, key), False, key
    if not settings.management_remote and not is_loopback(request):
        raise PermissionDenied(
            "without proxy keys the memory API answers only loopback clients;"
            " set MEMPROXY_API_KEYS, or MEMPROXY_MANAGEMENT_REMOTE=on"
        )
    return resolve_user(headers, {}, None) or DEFAULT_USER, False, None


def is_loopback(request: Request) -> bool:
    """Whether the client connected from this machine."""
    host = request.client.host if request.client else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def respond(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response."""
    return Response(orjson.dumps(payload), status, headers, media_type="application/json")


def page(data: list[Any], next_cursor: str | None) -> dict[str, Any]:
    """One page of a list, OpenAI-style, with the cursor of the next page."""
    return {
        "object": "list", "data": data, "has_more": next_cursor is not None,
        "next_cursor": next_cursor,
    }
