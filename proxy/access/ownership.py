"""Responses the upstream keeps, and whose they are.

Behind one shared upstream key the upstream sees one account, so it would serve any
caller any response id. memproxy stores each Responses reply under its user (the reply
turn's request id is the response id), so it knows whose the ids it has seen are. An id
stored for another user is answered as the upstream answers an id it does not know (404,
the same envelope): `previous_response_id` on POST /v1/responses, and GET/DELETE
/v1/responses/{id} with its /input_items and /cancel. An id memproxy never stored (memory
off at the time, another client of the same key) still goes to the upstream, which decides.

Other upstream objects (/v1/files, batches, vector stores, ...) are the upstream account's
own and pass through unchecked: memproxy does not see who made them.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from starlette.requests import Request

from config import ApiKey
from memory import MemoryEngine
from proxy.access.identity import resolve_user
from proxy.http.errors import NotFound, ProxyError
from proxy.http.logs import get_logger

# /v1/responses/{id}, /v1/responses/{id}/input_items, /v1/responses/{id}/cancel
_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/[^/]*)?")

log = get_logger("ownership")


class UnknownResponse(ProxyError):
    """OpenAI's answer for a response id it does not know (no code)."""

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


async def check_response_path(
    request: Request, key: ApiKey | None, memory: MemoryEngine | None
) -> None:
    """404 for /v1/responses/{id}[/...] when memproxy stored that response for another user
    (`key`: the proxy key the request was authenticated with)."""
    if memory is None:
        return
    match = _RESPONSE_PATH.fullmatch(unquote(request.url.path))
    if match is None:
        return
    user_id = resolve_user(request.headers, {}, key)
    try:
        elsewhere = await stored_elsewhere(memory, user_id, match[1])
    except Exception as exc:  # memory never breaks the relay: the upstream decides
        log.warning("response owner lookup failed", extra={"error": type(exc).__name__})
        return
    if elsewhere:
        raise UnknownResponse(f"Response with id '{match[1]}' not found.")
