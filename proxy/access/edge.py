"""What a request must look like before any route sees it (a pure ASGI middleware).

With no keys configured, the user's browser is a loopback client like any other, so any web
page it opens could send requests to memproxy: write or clear memory, chat on the
operator's upstream key, or read what the upstream keeps on that key. Four checks close
that, before routing:

- Path: one spelling (`proxy/http/paths.py`), so every check below, the router, access and
  ownership read the path the upstream gets.
- Host: a page whose DNS name an attacker pointed at 127.0.0.1 (DNS rebinding) sends its own
  name. Only memproxy's names pass (`MEMPROXY_ALLOWED_HOSTS`; unset: localhost and IP
  addresses, which no DNS answer can put in a browser's Host header for another site),
  unless every request needs a proxy key (a rebound page has none): while anything (a chat,
  the pass-through, memory on loopback) is served without a key, the Host is checked.
- Origin: a request from a web page of another origin (its `Origin` names another host,
  or, with none, `Sec-Fetch-Site` says anything but `same-origin`/`none`) is refused: every
  write, and on every path but the public ones (`PUBLIC_PATHS`, the panel's files) reads
  too, since a read of `/v1/...` is paid for by the operator's key or holds memory.
  memproxy sends no CORS headers (nor relays the upstream's: `proxy/upstream/client.py`).
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
from proxy.http.paths import normalised

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
# What a page of another origin may still read: liveness and readiness (no key pays for
# them; /metrics and /readyz's details have their own gate, proxy/access/decision.py) and
# the panel's static files (its data comes from /v1/memory, which is guarded).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/ui"})
PANEL_PREFIX = "/ui/"
# Sec-Fetch-Site values that prove a request is not from another site's page.
OWN_SITES = frozenset({b"same-origin", b"none"})

Render = Callable[[ProxyError], Response]


@dataclass(frozen=True)
class HostPolicy:
    """The Host names memproxy answers under."""

    any_host: bool
    names: frozenset[str] = frozenset()  # exact names; ".example.com" also its subdomains

    @classmethod
    def from_settings(cls, settings: Settings) -> HostPolicy:
        """`allowed_hosts`, else any name when every request needs a proxy key (a rebound
        page has none), else none but localhost, addresses and the bound name. An admin key
        or stored keys alone do not open it: keyless chats and the pass-through are still
        served on the operator's key."""
        if settings.allowed_hosts is not None:
            names = {name.strip().lower().rstrip(".") for name in settings.allowed_hosts.split(",")}
            return cls("*" in names, frozenset(names - {"*"}))
        if settings.keys_required:
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
        if scope["type"] == "http":
            scope = normalised(scope)  # before anything reads the path (proxy/http/paths.py)
            if (error := self.refusal(scope)) is not None:
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
        path = scope["path"]
        if scope["method"] in SAFE_METHODS and (
                path in PUBLIC_PATHS or path.startswith(PANEL_PREFIX)):  # any origin may read
            return None
        if origin is not None:
            if not self._own_origin(origin, host):
                return OriginRefused(f"requests from the web page at {origin!r} are refused"
                                     " (cross-origin)")
        elif fetch_site is not None and fetch_site not in OWN_SITES:
            # cross-site, same-site, or a value no browser sends. Sec-Fetch-Mode alone is no
            # sign of a page: Node's fetch (undici, under openai-node and the MCP TypeScript
            # SDK) sends `Sec-Fetch-Mode: cors` on every request, and a browser that sends
            # Sec-Fetch-Mode sends Sec-Fetch-Site with it (and Origin, cross-origin).
            return OriginRefused("requests from another site's web page are refused")
        if scope["method"] in SAFE_METHODS:
            return None
        return _media_type_refusal(path, content_type)

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
