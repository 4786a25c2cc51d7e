"""Objects the upstream keeps, and whose they are (docs/security.md, "Objects the upstream
keeps on a shared key").

Behind one shared upstream key the upstream sees one account, so it would serve any caller
any object of it. memproxy remembers each reply under the upstream's id for it (a
Responses reply under its response id, a chat completion under its `chatcmpl-` id), so it
knows whose the stored responses and stored chat completions (`store: true`) it has seen
are. An id stored for another user is answered as the upstream answers an id it does not
know (404, the same envelope): `previous_response_id` on POST /v1/responses, every method
on /v1/responses/{id} and /v1/chat/completions/{id} and everything under them
(/input_items, /cancel, /messages). An id memproxy never stored (memory off at the time,
another client of the same key) still goes to the upstream, which decides: such ids are
random, and the list that would give them away is refused.

What memproxy cannot know the owner of, a caller confined to one user or organisation
(`proxy.access.decision.confined_to_own`) does not reach on the operator's key: the list of
stored chat completions, and every account object (/v1/files, batches, vector stores,
assistants, ...) unless the operator says the account is shared
(`MEMPROXY_SHARED_ACCOUNT_OBJECTS=on`). Calls that keep nothing (`STATELESS`) pass.

Paths are read after `proxy/http/paths.py` made them one spelling, so `/v1//responses/x/`
is `/v1/responses/x` here and at the upstream.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from starlette.requests import Request

from config import ApiKey, Settings
from memory import MemoryEngine
from proxy.access.decision import confined_to_own
from proxy.access.identity import resolve_user
from proxy.http.errors import NotFound, PermissionDenied, ProxyError
from proxy.http.logs import get_logger

# /v1/responses/{id}[/...] and /v1/chat/completions/{id}[/...]: objects memproxy may own.
_OBJECT_PATH = re.compile(r"/v1/(responses|chat/completions)/([^/]+)(?:/.*)?")
NAMES = {"responses": "Response", "chat/completions": "Chat completion"}
LISTS = frozenset({"/v1/chat/completions"})  # a GET here lists every stored completion
# Calls that keep nothing on the account: (method, exact path or prefix ending in "/").
STATELESS = (
    ("GET", "/v1/models"), ("GET", "/v1/models/"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/completions"), ("POST", "/v1/moderations"), ("POST", "/v1/audio/"),
    ("POST", "/v1/images/"),
)

log = get_logger("ownership")


class UnknownObject(ProxyError):
    """OpenAI's answer for a response or completion id it does not know (no code)."""

    status, type = 404, "invalid_request_error"


async def stored_elsewhere(memory: MemoryEngine | None, user_id: str, reply_id: str) -> bool:
    """Whether memproxy stored the reply `reply_id` for a user other than `user_id`."""
    if memory is None:
        return False
    owner = await memory.reply_owner(reply_id)
    return owner is not None and owner != user_id


def previous_response_not_found(reply_id: str) -> NotFound:
    """What OpenAI answers for a `previous_response_id` it does not know."""
    return NotFound(f"Previous response with id '{reply_id}' not found.",
                    param="previous_response_id", code="previous_response_not_found")


async def check_upstream_path(
    request: Request, key: ApiKey | None, memory: MemoryEngine | None, settings: Settings,
    *, shared: bool,
) -> None:
    """404 for a response or completion memproxy stored for another user; 403 for what a
    confined caller may not reach on a `shared` key (module docstring). `key`: the proxy
    key the request was authenticated with."""
    path, method = request.scope["path"], request.method
    match = _OBJECT_PATH.fullmatch(path)
    if match is not None:
        # As it came (decoded once), and decoded once more, as an upstream might read it.
        for object_id in dict.fromkeys((match[2], unquote(match[2]))):
            await _check_owner(request, key, memory, NAMES[match[1]], object_id)
        return
    if not confined_to_own(key, shared=shared):
        return
    if path in LISTS and method in ("GET", "HEAD"):
        raise PermissionDenied(
            "listing stored chat completions is refused on a shared upstream key: the list"
            " holds every user's; read yours by id")
    if settings.shared_account_objects or _stateless(method, path):
        return
    raise PermissionDenied(
        f"{path} is an object of the upstream account, shared by every key of this memproxy:"
        " a key bound to a user or organisation does not reach it (an operator who means"
        " the account to be shared sets MEMPROXY_SHARED_ACCOUNT_OBJECTS=on)")


async def _check_owner(
    request: Request, key: ApiKey | None, memory: MemoryEngine | None, name: str, object_id: str
) -> None:
    if memory is None:
        return
    user_id = resolve_user(request.headers, {}, key)
    try:
        elsewhere = await stored_elsewhere(memory, user_id, object_id)
    except Exception as exc:  # memory never breaks the relay: the upstream decides
        log.warning("reply owner lookup failed", extra={"error": type(exc).__name__})
        return
    if elsewhere:
        raise UnknownObject(f"{name} with id '{object_id}' not found.")


def _stateless(method: str, path: str) -> bool:
    verb = "GET" if method == "HEAD" else method
    return any(verb == allowed and (path == spelled or (spelled.endswith("/") and path.startswith(spelled)))
               for allowed, spelled in STATELESS)
