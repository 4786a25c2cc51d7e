"""The model routing table and proxy keys, as parsed from settings."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Route:
    """Where requests for a model go.

    `match` is an exact model name, or a prefix when it ends in `*`. With `provider` set the
    request goes through litellm as `<provider>/<model>`; otherwise `base_url` names an
    OpenAI-compatible upstream and the body is relayed as sent. `context_window` (tokens)
    overrides litellm's figure for compaction.
    """

    match: str
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)  # never print keys
    provider: str | None = None
    context_window: int | None = field(default=None, repr=False)

    @property
    def is_prefix(self) -> bool:
        """True when `match` is a prefix pattern."""
        return self.match.endswith("*")

    def matches(self, model: str) -> bool:
        """Whether this route serves `model`."""
        if self.is_prefix:
            return model.startswith(self.match[:-1])
        return model == self.match


@dataclass(frozen=True)
class ApiKey:
    """A proxy key, optionally bound to one user id and to one organisation, whose shared
    memory it then reads (and, as an `org_writer`, writes through the memory API)."""

    key: str
    user_id: str | None = None
    org_id: str | None = None
    org_writer: bool = False
    # Usage, quotas and the admin API name a key by `key_id`, never by its secret: an
    # environment key's id is `env-` and a slow, truncated digest of the secret (an 8-char
    # key must not be guessable from its id); a stored key's, its row id.
    key_id: str = ""
    token_quota: int | None = None  # tokens per calendar month (UTC); None: no quota
    rate_limit: float | None = None  # requests per minute; None: MEMPROXY_RATE_LIMIT
    expires_at: float | None = None  # unix seconds; None: never

    def __post_init__(self) -> None:
        if not self.key_id:
            digest = hashlib.pbkdf2_hmac("sha256", self.key.encode(), b"memproxy key id", 20_000)
            object.__setattr__(self, "key_id", "env-" + digest.hex()[:12])

    def __repr__(self) -> str:  # never print keys
        return f"ApiKey(key_id={self.key_id!r}, user_id={self.user_id!r}, org_id={self.org_id!r})"


def parse_routes(value: Any) -> tuple[Route, ...]:
    """Routes from a TOML `[[routes]]` array of tables."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError("must be an array of tables ([[routes]])")
    routes = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"entry {i} must be a table")
        unknown = set(item) - {"match", "base_url", "api_key", "provider", "context_window"}
        if unknown:
            raise ValueError(f"entry {i} has unknown keys: {', '.join(sorted(unknown))}")
        match = item.get("match")
        if not isinstance(match, str) or not match:
            raise ValueError(f"entry {i} needs a non-empty string `match`")
        base_url, provider = item.get("base_url"), item.get("provider")
        if base_url is None and provider is None:
            raise ValueError(f"entry {i} ({match}) needs `base_url` or `provider`")
        if base_url is not None and not str(base_url).startswith(("http://", "https://")):
            raise ValueError(f"entry {i} ({match}): base_url must be an http(s) URL")
        window = item.get("context_window")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"entry {i} ({match}): context_window must be a positive integer")
        routes.append(Route(match, base_url, item.get("api_key"), provider, window))
    # Exact names win over prefixes; longer prefixes win over shorter ones.
    routes.sort(key=lambda r: (r.is_prefix, -len(r.match)))
    return tuple(routes)


def parse_api_keys(value: Any) -> tuple[ApiKey, ...]:
    """Keys from `k1,k2:user` (env) or a TOML list of such strings.

    Each entry is `key[:user][:org=ORG][:org-writer][:quota=N]`: the optional parts after
    the user put the key in an organisation, let it write the organisation's shared memory,
    and give it a monthly token quota (docs/usage.md).
    """
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, Sequence):
        raise ValueError(
            "must be a comma-separated list of key[:user][:org=ORG][:org-writer][:quota=N]"
        )
    keys = []
    for raw in items:
        text = str(raw).strip()
        if not text:
            continue
        key, *rest = text.split(":")
        if len(key) < 8:
            raise ValueError("every key must be at least 8 characters")
        org_id, writer, quota = None, False, None
        while rest and (rest[-1].startswith(("org=", "quota=")) or rest[-1] == "org-writer"):
            part = rest.pop()
            if part == "org-writer":
                writer = True
            elif part.startswith("quota="):
                quota = _quota(part.removeprefix("quota="))
            else:
                org_id = part.removeprefix("org=").strip() or None
        if writer and org_id is None:
            raise ValueError("org-writer needs the key's organisation (:org=ORG)")
        if org_id is not None and (len(org_id) > 256 or not org_id.isprintable()):
            raise ValueError("an organisation id is 1 to 256 printable characters")
        keys.append(ApiKey(key, ":".join(rest) or None, org_id, writer, token_quota=quota))
    return tuple(keys)


def _quota(text: str) -> int:
    """A monthly token quota: a whole number of tokens, 0 or more."""
    if not text.isdigit() or len(text) > 15:
        raise ValueError(f"quota= takes a whole number of tokens, 0 or more, not {text!r}")
    return int(text)
