"""The memory API's side of access, and how its failures look on the wire.

Who may reach which memory is decided once, in proxy/access/decision.py (its table): a key bound to
a user reaches that user; an unbound key names the user like a chat request does
(X-Memory-User-Id, else `default`); an organisation's key without a user names one of its
organisation's members; the admin key reaches any user. Without keys (local single-user
mode) only loopback clients are served, unless MEMPROXY_MANAGEMENT_REMOTE is on. Requests
count against the caller's key in the same rate limit as chat completions (proxy/access/limits.py).

With X-Memory-Org-Id a request reaches an organisation's shared memory instead (facts,
search, export, clearing and stats only); who reads and who changes it is in the same table.
Chat requests never write it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from config import Settings
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
from proxy.access.decision import Action, Principal, decide, identify
from proxy.access.identity import resolve_org, resolve_session, resolve_user
from proxy.access.limits import limit_keys
from proxy.http.errors import (
    Conflict,
    InvalidRequest,
    MemoryUnavailable,
    NotFound,
)
from proxy.state import AppState


@dataclass(frozen=True)
class Caller:
    """An authorised management request, or /mcp message: whose memory it reaches and
    through what.

    `user_id` is the memory reached: a user's, or an organisation's shared memory (then
    `shared` is true); `org_id` is the organisation whose shared memory recall adds."""

    user_id: str
    principal: Principal  # who asks (proxy/access/decision.py)
    memory: MemoryEngine
    settings: Settings
    org_id: str | None = None
    shared: bool = False
    # An /mcp message's: X-Memory-Session-Id, and the client's name for provenance (its
    # client info, else its User-Agent; proxy/mcp/caller.py).
    session_id: str | None = None
    client: str | None = None

    def decide(self, *, user_id: str | None, org_id: str | None, action: Action) -> None:
        """The one access decision (proxy/access/decision.py) for this caller."""
        decide(self.principal, self.settings, user_id=user_id, org_id=org_id, action=action)


Handler = Callable[[Request, Caller], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def endpoint(handler: Handler) -> Endpoint:
    """Authorise the request, run the handler, and turn memory errors into API errors."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        who = await authorise(request)
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


async def authorise(request: Request, *, tools: bool = False) -> Caller:
    """The caller of a management request (`tools`: of an /mcp message); 401, 403, 429 or
    503 when it cannot be served.

    Whose memory it reaches is decided by proxy/access/decision.py, as for every chat request.
    An /mcp message reads (a tool that changes memory asks `decide` itself, proxy/mcp/tools.py),
    and its X-Memory-Org-Id names the organisation recall adds, not the memory reached."""
    state: AppState = request.app.state.memproxy
    settings = state.settings
    principal = await identify(request, settings, admin_allowed=True, stored=state.keys)
    headers = request.headers
    user_id = resolve_user(headers, {}, principal.key)
    org_id = resolve_org(headers, principal.key)
    action: Action = "read" if tools or request.method in ("GET", "HEAD") else "write"
    shared = not tools and "x-memory-org-id" in headers
    if shared and org_id is not None:
        part = _shared_part(request)
        decide(principal, settings, user_id=None, org_id=org_id,
               action="read" if part == "search" else action)
        user_id = organization_memory(org_id)
    else:
        decide(principal, settings, user_id=user_id, org_id=org_id, action=action)
    if state.memory is None:
        raise MemoryUnavailable("memory is turned off on this proxy")
    session_id = None
    if tools and "x-memory-session-id" in headers:
        session_id = resolve_session(headers, user_id, [])
    key = principal.key
    if state.limits.applies(key):
        # The bucket chat completions use: the key presented (a proxy key has been checked
        # by now, and the admin key counts as any key does), else the user. Every /mcp
        # message counts, not only tool calls: a resource read or a listing costs a database
        # read as a search does (docs/security.md, "MCP messages past the rate limit").
        await state.limits.take(key, limit_keys(key, request, user_id, settings), stream=False)
    return Caller(user_id, principal, state.memory, settings, org_id, shared, session_id)


# What an organisation's shared memory offers through the API (it has no turns, sessions
# or profile); a path is matched by its first part after /v1/memory/.
SHARED_PATHS = frozenset({"facts", "search", "export", "clear", "stats"})


def _shared_part(request: Request) -> str:
    """The resource a request on shared memory names; 400 for one shared memory lacks."""
    part = request.url.path.removeprefix("/v1/memory/").split("/", 1)[0]
    if part not in SHARED_PATHS:
        raise InvalidRequest(
            f"/v1/memory/{part} is not available for an organisation's shared memory",
            param="X-Memory-Org-Id",
        )
    return part


def respond(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response."""
    return Response(orjson.dumps(payload), status, headers, media_type="application/json")


def page(data: list[Any], next_cursor: str | None) -> dict[str, Any]:
    """One page of a list, OpenAI-style, with the cursor of the next page."""
    return {
        "object": "list", "data": data, "has_more": next_cursor is not None,
        "next_cursor": next_cursor,
    }
