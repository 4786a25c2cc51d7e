"""The one access decision: may this caller read or change this user's (or organisation's)
memory? Every way in asks `decide`: chat completions, Responses and Messages (recall,
injection, dry run, tool mode, compaction, the stored conversation a request continues),
and the memory API (and so the CLI and the panel): facts, turns, search, export, import,
clear, profile, stats.

    caller                                   a user's memory            an org's shared memory
    admin key                                any user                   any org, read and write
    key bound to a user (`k:alice`)          that user only             its own org: read; write
                                                                        with :org-writer
    org key without a user (`k:org=acme`)    the org's members only     its own org: read; write
                                                                        with :org-writer
    unbound key (`k`)                        any user                   any org: read only
    keys configured, no valid key            none (401)                 none (401)
    no keys, loopback client                 any user                   any org, read and write
    no keys, remote client                   none (403), unless         none (403), unless
                                             MEMPROXY_MANAGEMENT_REMOTE MEMPROXY_MANAGEMENT_REMOTE

An organisation's members are the users that keys of that organisation are bound to in
MEMPROXY_API_KEYS (`k2:bob:org=acme` makes bob a member of acme) or in the database (live
stored keys, docs/keys.md). "Keys configured" means MEMPROXY_API_KEYS, MEMPROXY_AUTH=keys or
MEMPROXY_ADMIN_KEY: with only the admin key set, every other request is a caller without a
valid key. Chats never write an organisation's shared memory.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from starlette.requests import Request

from config import ApiKey, Flags, Settings
from proxy.access.identity import authenticate, presented_key
from proxy.access.stored_keys import StoredKeys
from proxy.http.errors import AuthenticationFailed, PermissionDenied, ProxyError

Action = Literal["read", "write"]


@dataclass(frozen=True)
class Principal:
    """Who is asking: the proxy key presented (None: none configured, or the admin key),
    whether it is the admin key, and whether the client is on this machine."""

    key: ApiKey | None
    admin: bool = False
    loopback: bool = False
    # For a key of an organisation bound to no user: the users stored keys of that
    # organisation are bound to (members from MEMPROXY_API_KEYS are in `members()`).
    stored_members: frozenset[str] = frozenset()


async def identify(
    request: Request, settings: Settings, *, admin_allowed: bool, stored: StoredKeys | None
) -> Principal:
    """The caller of `request`; 401 when proxy keys are on and its key is missing or wrong.

    The admin key counts only where `admin_allowed` (the memory API): chats never take it,
    so with only the admin key configured a chat goes through as a bring-your-own-key
    request whose memory `decide` refuses. `stored`: the keys in the database (None: memory,
    and so the database, is off).
    """
    loopback = is_loopback(request, relayed_trusted=settings.trusted_proxies is not None)
    admin_key = settings.admin_key
    if admin_allowed and admin_key:
        presented = presented_key(request.headers)
        if presented and hmac.compare_digest(presented.encode(), admin_key.encode()):
            return Principal(None, admin=True, loopback=loopback)
    key = await authenticate(request.headers, settings, stored)
    if key is not None and key.org_id is not None and key.user_id is None and stored is not None:
        return Principal(key, loopback=loopback, stored_members=await stored.members(key.org_id))
    return Principal(key, loopback=loopback)


async def require_admin(
    request: Request, settings: Settings, stored: StoredKeys | None
) -> Principal:
    """The admin API (`/v1/admin/`): the admin key only. 403 when none is configured (no
    other caller, loopback included, manages keys or reads usage), 401 for a missing or
    wrong key, 403 for a valid key that is not the admin key."""
    if not settings.admin_key:
        raise PermissionDenied("the admin API needs MEMPROXY_ADMIN_KEY to be set")
    presented = presented_key(request.headers)
    if not presented:
        raise AuthenticationFailed("missing API key: send the admin key as a Bearer token")
    principal = await identify(request, settings, admin_allowed=True, stored=stored)
    if principal.key is None and not principal.admin:
        raise AuthenticationFailed("incorrect API key provided")
    if not principal.admin:
        raise PermissionDenied("the admin API answers the admin key only")
    return principal


def require_operator(request: Request, settings: Settings) -> None:
    """/metrics and /readyz's details (docs/security.md, "Operations endpoints"): a client
    on this machine (not relayed by a proxy there), MEMPROXY_METRICS_KEY or the admin key as
    a Bearer token; with no key of any kind configured, anyone (one local user, or an
    operator who opened memproxy on purpose). Else 401, or 403 when no key could do."""
    secrets = [secret for secret in (settings.metrics_key, settings.admin_key) if secret]
    if not (secrets or settings.keys_required):
        return
    if is_loopback(request, relayed_trusted=settings.trusted_proxies is not None):
        return
    if not secrets:
        raise PermissionDenied("/metrics and /readyz's details answer remote clients only with"
                               " MEMPROXY_METRICS_KEY (or MEMPROXY_ADMIN_KEY) set")
    presented = presented_key(request.headers)
    if not presented:
        raise AuthenticationFailed("missing API key: send MEMPROXY_METRICS_KEY or the admin key"
                                   " as a Bearer token")
    # Each secret compared, in constant time: a list, so no match ends the comparisons early.
    if not any([hmac.compare_digest(presented.encode(), secret.encode()) for secret in secrets]):
        raise AuthenticationFailed("incorrect API key provided")


def decide(
    principal: Principal, settings: Settings, *, user_id: str | None, org_id: str | None,
    action: Action,
) -> None:
    """Allow `action` on `user_id`'s memory (with `org_id`'s shared memory read alongside),
    or, with `user_id` None, on `org_id`'s shared memory; else raise 401 or 403."""
    if principal.admin:
        return
    key = principal.key
    if key is None:
        if settings.keys_required or settings.admin_key:
            raise AuthenticationFailed(
                "memory needs a valid API key: send a memproxy key as a Bearer token"
            )
        if principal.loopback or settings.management_remote:
            return  # local single-user mode, or an operator who opened it on purpose
        raise PermissionDenied(
            "without proxy keys memory answers only loopback clients;"
            " set MEMPROXY_API_KEYS, or MEMPROXY_MANAGEMENT_REMOTE=on"
        )
    if user_id is not None:
        _check_user(key, principal.stored_members, settings.api_keys, user_id)
    if org_id is not None:
        _check_org(key, org_id, "write" if user_id is None and action == "write" else "read")


def chat_flags(
    principal: Principal, settings: Settings, flags: Flags, *, user_id: str, org_id: str | None
) -> tuple[Flags, ProxyError | None]:
    """The flags a chat request runs with: as asked when its caller may reach the memory,
    else memory off and the refusal, which X-Memory-Error reports (memory never breaks the
    chat). A dry run only reads memory: it answers the refusal, as the memory API does."""
    if not (flags.active or flags.compact):
        return flags, None  # memory off: nothing to decide, nothing to hash
    try:
        decide(principal, settings, user_id=user_id, org_id=org_id,
               action="write" if flags.write else "read")
    except ProxyError as exc:
        if flags.dry_run:
            raise
        return dataclasses.replace(flags, read=False, write=False, compact=False), exc
    return flags, None


def _check_user(
    key: ApiKey, stored_members: frozenset[str], keys: tuple[ApiKey, ...], user_id: str
) -> None:
    if key.user_id is not None:
        if user_id != key.user_id:
            raise PermissionDenied("this API key is bound to another user", param="X-Memory-User-Id")
    elif (key.org_id is not None and user_id not in stored_members
          and user_id not in members(keys).get(key.org_id, ())):
        raise PermissionDenied(
            f"user {user_id!r} is not a member of this API key's organisation",
            param="X-Memory-User-Id",
        )


def _check_org(key: ApiKey, org_id: str, action: Action) -> None:
    if key.org_id is not None and key.org_id != org_id:
        raise PermissionDenied(
            "this API key belongs to another organisation", param="X-Memory-Org-Id"
        )
    if key.org_id is None and key.user_id is not None:
        raise PermissionDenied("this API key belongs to no organisation", param="X-Memory-Org-Id")
    if action == "write" and not key.org_writer:
        raise PermissionDenied(
            "this API key may read but not change the organisation's shared memory",
            param="X-Memory-Org-Id",
        )


@lru_cache(maxsize=8)
def members(keys: tuple[ApiKey, ...]) -> Mapping[str, frozenset[str]]:
    """{organisation: the users keys of it are bound to} (settings are frozen: computed once)."""
    found: dict[str, set[str]] = {}
    for key in keys:
        if key.org_id is not None and key.user_id is not None:
            found.setdefault(key.org_id, set()).add(key.user_id)
    return {org: frozenset(users) for org, users in found.items()}


def confined_to_own(key: ApiKey | None, *, shared: bool) -> bool:
    """Whether the caller may reach only its own objects on the upstream account: a key bound
    to a user or an organisation, while the operator's key goes upstream (`shared`: every
    key holder's objects live in one account; proxy/access/ownership.py). An unbound key
    speaks for any user, and without keys there is one user."""
    return shared and key is not None and (key.user_id is not None or key.org_id is not None)


# Headers a reverse proxy adds for the client it relays (RFC 7239, and the de facto ones).
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def is_loopback(request: Request, *, relayed_trusted: bool = False) -> bool:
    """Whether the client is on this machine: it connected from loopback, and did not come
    through a reverse proxy there. Unless the operator named trusted proxies (uvicorn then
    puts the client they name in the scope: `relayed_trusted`), a forwarding header on a
    loopback connection means a proxy relayed someone else (docs/security.md)."""
    host = request.client.host if request.client else ""
    if not relayed_trusted and any(name in request.headers for name in FORWARDING_HEADERS):
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))
