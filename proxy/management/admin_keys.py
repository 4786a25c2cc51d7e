"""The admin API's keys (docs/keys.md): /v1/admin/keys, the admin key only.

    POST   /v1/admin/keys         make a key; the answer holds its secret, once
    GET    /v1/admin/keys         every key, stored and from MEMPROXY_API_KEYS, never a secret
    GET    /v1/admin/keys/{id}    one key
    PATCH  /v1/admin/keys/{id}    change expires_at, rate_limit, token_quota, org_writer
    DELETE /v1/admin/keys/{id}    revoke (409 when it is already revoked)

Keys from MEMPROXY_API_KEYS are listed with `source: "env"` and cannot change here (409).
A stored key changed or revoked here is dropped from this replica's cache at once; other
replicas see it within their cache's TTL (proxy/access/stored_keys.py). Bad input is refused
before anything is written.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from config import ApiKey, Settings
from memory import KeyNotFound, KeyRevoked, StoredKey
from proxy.access.decision import require_admin
from proxy.access.stored_keys import StoredKeys
from proxy.http.errors import Conflict, InvalidRequest, MemoryUnavailable, NotFound
from proxy.management.access import Endpoint, respond
from proxy.management.answers import ApiKey as ApiKeyAnswer
from proxy.management.bodies import ApiKeyChanges, NewApiKey
from proxy.management.inputs import json_body
from proxy.management.operations import declare
from proxy.state import AppState

Handler = Callable[[Request, Settings, StoredKeys], Awaitable[Response]]


def admin(handler: Handler) -> Endpoint:
    """The admin key first, then the handler with this replica's cache of the key store
    (`keys.store`)."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        state: AppState = request.app.state.memproxy
        await require_admin(request, state.settings, state.keys)
        if state.memory is None or state.keys is None:
            raise MemoryUnavailable("stored keys need the memory database, which is off here")
        return await handler(request, state.settings, state.keys)

    return run


@declare(admin, "GET /keys", "Every key: MEMPROXY_API_KEYS's (source env) and the stored"
         " ones; never a secret", "ApiKeyList")
async def list_keys(request: Request, settings: Settings, keys: StoredKeys) -> Response:
    """GET /v1/admin/keys: the environment's keys, then the stored ones, oldest first."""
    listed = [env_json(key) for key in settings.api_keys]
    listed += [stored_json(key) for key in await keys.store.all()]
    return respond({"object": "list", "data": listed})


@declare(admin, "POST /keys", "Make a key; its secret is in `key`, shown this once",
         "ApiKeyCreated", "400", "413", status="201", body=NewApiKey)
async def create_key(request: Request, settings: Settings, keys: StoredKeys) -> Response:
    """POST /v1/admin/keys: 201 with the secret in `key` (never shown again)."""
    body = await json_body(request, settings.max_body_bytes, NewApiKey)
    if body.org_writer and body.org is None:
        raise InvalidRequest("org_writer needs the key's organisation (org)", param="org_writer")
    stored, secret = await keys.store.create(
        user_id=body.user, org_id=body.org, org_writer=bool(body.org_writer),
        expires_at=_future(body.expires_at), rate_limit=body.rate_limit,
        token_quota=body.token_quota,
    )
    keys.forget(stored.id)  # an org's members may have grown
    return respond({**stored_json(stored), "key": secret}, 201)


@declare(admin, "GET /keys/{key_id}", "One key", "ApiKey", "404")
async def get_key(request: Request, settings: Settings, keys: StoredKeys) -> Response:
    """GET /v1/admin/keys/{key_id}"""
    key_id = request.path_params["key_id"]
    env = _env_key(settings, key_id)
    if env is not None:
        return respond(env_json(env))
    return respond(stored_json(await _stored(keys.store.get(key_id))))


@declare(admin, "PATCH /keys/{key_id}",
         "Change expires_at, rate_limit, token_quota or org_writer (null clears)", "ApiKey",
         "400", "404", "409", "413", body=ApiKeyChanges)
async def change_key(request: Request, settings: Settings, keys: StoredKeys) -> Response:
    """PATCH /v1/admin/keys/{key_id}: null clears expires_at, rate_limit or token_quota."""
    key_id = _changeable(settings, request.path_params["key_id"])
    changes = (await json_body(request, settings.max_body_bytes, ApiKeyChanges)).given()
    _future(changes.get("expires_at"))
    current = await _stored(keys.store.get(key_id))
    if changes.get("org_writer") and current.org_id is None:
        raise InvalidRequest("org_writer needs a key of an organisation", param="org_writer")
    changed = await _stored(keys.store.change(key_id, changes))
    keys.forget(key_id)
    return respond(stored_json(changed))


@declare(admin, "DELETE /keys/{key_id}", "Revoke a key (409: already revoked)", "ApiKey",
         "404", "409")
async def revoke_key(request: Request, settings: Settings, keys: StoredKeys) -> Response:
    """DELETE /v1/admin/keys/{key_id}: revoke; 409 when already revoked, 404 unknown."""
    key_id = _changeable(settings, request.path_params["key_id"])
    revoked = await _stored(keys.store.revoke(key_id))
    keys.forget(key_id)
    return respond(stored_json(revoked))


def stored_json(key: StoredKey) -> dict[str, Any]:
    """A stored key as the API shows it (never its secret nor its digest)."""
    now = time.time()
    status = (
        "revoked" if key.revoked_at is not None
        else "expired" if key.expires_at is not None and key.expires_at <= now
        else "active"
    )
    return {
        "object": "api_key", "id": key.id, "source": "database", "prefix": key.prefix,
        "user": key.user_id, "org": key.org_id, "org_writer": key.org_writer,
        "expires_at": key.expires_at, "rate_limit": key.rate_limit,
        "token_quota": key.token_quota, "created_at": key.created_at,
        "last_used_at": key.last_used_at, "revoked_at": key.revoked_at, "status": status,
    }


def env_json(key: ApiKey) -> dict[str, Any]:
    """A MEMPROXY_API_KEYS key as the API shows it: no prefix (it is part of the secret)."""
    return {  # every field of the answer, in its order, null unless said here
        **dict.fromkeys(ApiKeyAnswer.__annotations__), "object": "api_key", "id": key.key_id,
        "source": "env", "user": key.user_id, "org": key.org_id, "org_writer": key.org_writer,
        "status": "active",
    }


def _env_key(settings: Settings, key_id: str) -> ApiKey | None:
    return next((k for k in settings.api_keys if k.key_id == key_id), None)


def _changeable(settings: Settings, key_id: str) -> str:
    if _env_key(settings, key_id) is not None:
        raise Conflict(
            f"key {key_id!r} comes from MEMPROXY_API_KEYS and is read-only here: change that"
            " setting and restart, or make a stored key", param="key_id", code="env_key_read_only",
        )
    return key_id


async def _stored(pending: Awaitable[StoredKey]) -> StoredKey:
    """The key an operation answers; its failures as API errors."""
    try:
        return await pending
    except KeyNotFound as exc:
        raise NotFound(str(exc), param="key_id", code="key_not_found") from None
    except KeyRevoked as exc:
        raise Conflict(str(exc), param="key_id", code="key_revoked") from None


def _future(at: float | None) -> float | None:
    """An expiry time, which must be in the future (the body's schema cannot say so)."""
    if at is not None and at <= time.time():
        raise InvalidRequest("expires_at is in the past: give a future time in unix seconds",
                             param="expires_at")
    return at
