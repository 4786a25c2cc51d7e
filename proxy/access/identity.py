"""Who is asking: proxy-key authentication, then the user and the session (docs/architecture.md, "Request flow")."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from config import ApiKey, Settings
from memory import SECRET_PREFIX, message_text
from proxy.http.errors import AuthenticationFailed, InvalidHeader, PermissionDenied

if TYPE_CHECKING:
    from proxy.access.stored_keys import StoredKeys

DEFAULT_USER = "default"
MAX_ID_LENGTH = 256


@dataclass(frozen=True)
class Identity:
    """The resolved user and session of one request, and the user's organisation."""

    user_id: str
    session_id: str
    org_id: str | None = None


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client sent: `Authorization: Bearer`, `api-key` or `x-api-key`."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return headers.get("api-key") or headers.get("x-api-key")


async def authenticate(
    headers: Mapping[str, str], settings: Settings, stored: StoredKeys | None
) -> ApiKey | None:
    """The proxy key presented: one of MEMPROXY_API_KEYS, else a stored key (docs/keys.md).

    None when none is required and none of memproxy's was sent (bring-your-own-key: the
    client's own key goes upstream); 401 when one is required and missing or wrong. A secret
    in a stored key's form is always checked, never forwarded: a revoked one is a 401 even
    where keys are not required.
    """
    presented = presented_key(headers)
    if presented and settings.api_keys:
        match = None
        candidate = presented.encode()
        # Compare against every key, constant-time each, so timing reveals nothing.
        for key in settings.api_keys:
            if hmac.compare_digest(candidate, key.key.encode()):
                match = key
        if match is not None:
            return match
    if presented and stored is not None and presented.startswith(SECRET_PREFIX):
        return await stored.find(presented)
    if not settings.keys_required:
        return None
    if not presented:
        raise AuthenticationFailed("missing API key: send a memproxy key as a Bearer token")
    if settings.admin_key and hmac.compare_digest(presented.encode(), settings.admin_key.encode()):
        # Reached only where the admin key does not count (a chat, MCP): say what it is for.
        raise AuthenticationFailed(
            "this is the admin key: it manages memory and keys (/v1/memory, /v1/admin, the"
            " CLI) and does not chat; send a proxy key (MEMPROXY_API_KEYS or memproxy keys"
            " create)"
        )
    raise AuthenticationFailed("incorrect API key provided")


def proxy_key_sent(headers: Mapping[str, str], settings: Settings) -> bool:
    """Whether the client's credential is memproxy's own (a proxy key or the admin key), so
    it must not go upstream nor be lent to learning: keys are required, it has a stored
    key's form, or it is the admin key (which a chat does not take, but must not leak)."""
    if settings.keys_required:
        return True
    presented = presented_key(headers)
    if not presented:
        return False
    if presented.startswith(SECRET_PREFIX):
        return True
    admin = settings.admin_key
    return admin is not None and hmac.compare_digest(presented.encode(), admin.encode())


def resolve_user(headers: Mapping[str, str], body: Mapping[str, Any], key: ApiKey | None) -> str:
    """Header, then body `user`, `metadata.user_id`, `safety_identifier`, the key's user."""
    header = _id_header(headers, "x-memory-user-id", "X-Memory-User-Id")
    if key is not None and key.user_id is not None:
        # A key bound to a user reaches that user's memory only.
        if header is not None and header != key.user_id:
            raise PermissionDenied("this API key is bound to another user", param="X-Memory-User-Id")
        return key.user_id
    if header is not None:
        return header
    metadata = body.get("metadata")
    for value in (
        body.get("user"),
        metadata.get("user_id") if isinstance(metadata, Mapping) else None,
        body.get("safety_identifier"),
    ):
        if isinstance(value, str) and value.strip():
            return _bounded(value.strip())
    return DEFAULT_USER


def resolve_org(headers: Mapping[str, str], key: ApiKey | None) -> str | None:
    """The organisation whose shared memory the request may reach: the key's, else the
    X-Memory-Org-Id header (with keys off, or a key bound to neither user nor org)."""
    header = _id_header(headers, "x-memory-org-id", "X-Memory-Org-Id")
    if key is not None and key.org_id is not None:
        if header is not None and header != key.org_id:
            raise PermissionDenied(
                "this API key belongs to another organisation", param="X-Memory-Org-Id"
            )
        return key.org_id
    if header is not None and key is not None and key.user_id is not None:
        # A key bound to a user reaches no memory but that user's and its own org's.
        raise PermissionDenied("this API key belongs to no organisation", param="X-Memory-Org-Id")
    return header


def _bounded(user_id: str) -> str:
    """An id over MAX_ID_LENGTH keeps a prefix plus a digest of the whole: two long ids
    that share a prefix stay two users (plain truncation merged their memories)."""
    if len(user_id) <= MAX_ID_LENGTH:
        return user_id
    digest = hashlib.sha256(user_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{user_id[: MAX_ID_LENGTH - 33]}~{digest}"


def resolve_session(
    headers: Mapping[str, str], user_id: str, messages: Sequence[Any], *,
    continued: str | None = None,
) -> str:
    """The X-Memory-Session-Id header, else the session of the stored conversation this
    request continues (`continued`), else a fingerprint of the conversation's start."""
    header = _id_header(headers, "x-memory-session-id", "X-Memory-Session-Id")
    if header is not None:
        return header
    return continued or conversation_fingerprint(user_id, messages)


def conversation_fingerprint(user_id: str, messages: Sequence[Any]) -> str:
    """A stable id from the system prompt and the first user message."""
    system = first_user = ""
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role in ("system", "developer") and not system:
            system = message_text(message.get("content"))
        elif role == "user":
            first_user = message_text(message.get("content"))
            break
    digest = hashlib.sha256("\0".join((user_id, system, first_user)).encode()).hexdigest()
    return "fp-" + digest[:24]


def _id_header(headers: Mapping[str, str], name: str, title: str) -> str | None:
    raw = headers.get(name)
    if raw is None:
        return None
    value = _utf8(raw).strip()
    if not value or len(value) > MAX_ID_LENGTH or not value.isprintable():
        raise InvalidHeader(
            title, f"{title} must be 1 to {MAX_ID_LENGTH} printable characters"
        )
    return value


def _utf8(raw: str) -> str:
    # Starlette decodes header bytes as latin-1; clients send non-ASCII ids as UTF-8, the
    # encoding body ids arrive in, so one user is the same user through either.
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return raw
