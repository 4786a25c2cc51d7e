"""What a request must look like before any route sees it (a pure ASGI middleware).

With no keys configured, the user's browser is a loopback client like any other, so any web
page it opens could send requests to memproxy: write or clear memory, or chat on the
operator's upstream key. Three checks close that, before routing:

- Host: a page whose DNS name an attacker pointed at 127.0.0.1 (DNS rebinding) sends its own
  name. Only memproxy's names pass (`MEMPROXY_ALLOWED_HOSTS`; unset, without keys: localhost
  and IP addresses, which no DNS answer can put in a browser's Host header for another site).
- Origin: a write (any method but GET, HEAD, OPTIONS) whose `Origin` names another host, or
  that has none but `Sec-Fetch-Site: cross-site`/`same-site`, is refused, on every route.
- Content-Type: memproxy's own JSON endpoints take JSON only (or no Content-Type, as
  non-browser clients may send), never the form and text types a browser sends cross-origin
  without a preflight (Fetch standard, "CORS-safelisted request-header").

A refused request never reaches a route, so nothing is read, parsed or authenticated first.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from config import Settings
from proxy.http.errors import HostNotAllowed, OriginRefused, ProxyError, UnsupportedMediaType

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443}
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})

JSON_TYPES = frozenset({"application/json"})
# Import takes JSON Lines too (the CLI sends application/x-ndjson).
IMPORT_TYPES = frozenset({"application/json", "application/x-ndjson", "application/jsonl"})
# memproxy's own JSON endpoints; every other /v1 path is relayed as sent (file uploads are
# multipart there), guarded by the Origin check alone.
JSON_PATHS = frozenset({
    "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/mcp",
})
MEMORY_PREFIX = "/v1/memory/"
ADMIN_PREFIX = "/v1/admin/"  # the admin API (docs/keys.md): JSON only, like the memory API
IMPORT_PATH = "/v1/memory/import"

Render = Callable[[ProxyError], Response]


@dataclass(frozen=True)
class HostPolicy:
    """The Host names memproxy answers under."""

    any_host: bool
    names: frozenset[str] = frozenset()  # exact names; ".example.com" also its subdomains

    @classmethod
    def from_settings(cls, settings: Settings) -> HostPolicy:
        """`allowed_hosts`, else any name with keys (a rebound page has no key), else none
        but localhost, addresses and the bound name."""
        if settings.allowed_hosts is not None:
            names = {name.strip().lower().rstrip(".") for name in settings.allowed_hosts.split(",")}
            return cls("*" in names, frozenset(names - {"*"}))
        if settings.keys_required or settings.admin_key:
            return cls(True)
        bound = settings.host.strip().lower()
        return cls(False, frozenset() if bound in WILDCARD_BINDS else frozenset({bound}))

    def allows(self, name: str) -> bool:
        """Whether a request whose Host names `name` is for this server."""
        if self.any_host or name == "localhost" or name.endswith(".localhost"):
            return True
        return listed(name, self.names) or _is_address(name)


class EdgeGuard:
    """Refuse requests from other sites and other names before routing (module docstring)."""

    def __init__(self, app: ASGIApp, settings: Settings,
                 envelopes: Mapping[str, Render] | None = None) -> None:
        self.app = app
        self.hosts = HostPolicy.from_settings(settings)
        # Names the operator listed are this server's under any Host a proxy in front sends.
        self.own_names = self.hosts.names if settings.allowed_hosts is not None else frozenset()
        # Paths (by prefix) whose errors use another format's envelope than OpenAI's.
        self.envelopes = dict(envelopes or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (error := self.refusal(scope)) is not None:
            response = self._render(scope["path"], error)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> ProxyError | None:
        """Why this request is refused, or None."""
        host = origin = content_type = fetch_site = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = host if host is not None else value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"sec-fetch-site":
                fetch_site = value
        if host and not self.hosts.allows(split_authority(host)[0]):
            return HostNotAllowed(
                f"this memproxy does not answer under the name {host!r}: add it to"
                " MEMPROXY_ALLOWED_HOSTS (a guard against DNS rebinding)"
            )
        if scope["method"] in SAFE_METHODS:
            return None
        if origin is not None:
            if not self._own_origin(origin, host):
                return OriginRefused(f"requests from the web page at {origin!r} are refused"
                                     " (cross-origin)")
        elif fetch_site in (b"cross-site", b"same-site"):
            return OriginRefused("requests from another site's web page are refused")
        return _media_type_refusal(scope["path"], content_type)

    def _own_origin(self, origin: str, host: str | None) -> bool:
        """Whether `origin` is this server: the Host's name (and its port, when the Host
        carries one: a proxy in front may drop it) or a name the operator listed."""
        parts = urlsplit(origin.strip())
        try:
            port = parts.port or DEFAULT_PORTS.get(parts.scheme)
        except ValueError:
            return False
        name = (parts.hostname or "").rstrip(".")
        if parts.scheme not in DEFAULT_PORTS or not name:
            return False  # "null" (a sandboxed or file: page), or not a web origin
        if listed(name, self.own_names):
            return True
        if not host:
            return False
        host_name, host_port = split_authority(host)
        return name == host_name and host_port in (None, port)

    def _render(self, path: str, error: ProxyError) -> Response:
        for prefix, render in self.envelopes.items():
            if path == prefix or path.startswith(prefix + "/"):
                return render(error)
        return error.to_response()


def _media_type_refusal(path: str, content_type: str | None) -> ProxyError | None:
    if (path in JSON_PATHS or path.startswith(ADMIN_PREFIX)
            or (path.startswith(MEMORY_PREFIX) and path != IMPORT_PATH)):
        allowed = JSON_TYPES
    elif path == IMPORT_PATH:
        allowed = IMPORT_TYPES
    else:
        return None
    essence = (content_type or "").split(";", 1)[0].strip().lower()
    if not essence or essence in allowed:
        return None
    return UnsupportedMediaType(
        f"{path} takes {' or '.join(sorted(allowed))}, not {essence!r}:"
        " send Content-Type: application/json"
    )


def listed(name: str, names: frozenset[str]) -> bool:
    """Whether `name` (a bare host name, lower case) is one of `names`; an entry starting
    with a dot also matches its subdomains."""
    return name in names or any(
        entry.startswith(".") and (name == entry[1:] or name.endswith(entry)) for entry in names
    )


def split_authority(value: str) -> tuple[str, int | None]:
    """A Host header's name (lower case, no brackets or trailing dot) and port, if any."""
    value = value.strip().lower()
    port = ""
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name = value  # no port, or a bare IPv6 address
    return name.rstrip("."), int(port) if port.isdigit() else None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.partition("%")[0])
    except ValueError:
        return False
    return True
