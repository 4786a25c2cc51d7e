"""Who can reach this memproxy, and on whose key: said once at start (docs/security.md,
"An open relay"; docs/deploy.md).

Some shapes are quietly wrong: bound to every interface with the operator's upstream key and
no proxy keys, anyone on the network chats on that key (the Docker image binds 0.0.0.0);
bound beyond loopback without keys, memory is off for every remote client; proxy keys
required but no upstream key, chats reach the upstream with no credential at all (a client's
key is memproxy's own then, never forwarded). `memproxy serve` refuses the first unless
`MEMPROXY_OPEN_RELAY=on` says it is meant, and the ready line warns for each.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from config import Settings

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def beyond_loopback(host: str) -> bool:
    """Whether binding `host` lets other machines connect (a wildcard, a non-loopback
    address, or a name, which may resolve anywhere)."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(name).is_loopback
    except ValueError:
        return True


def upstream_keys(settings: Settings) -> list[str]:
    """The settings that hold a key the operator pays with, for requests to spend."""
    named = [name for name, value in (("MEMPROXY_UPSTREAM_API_KEY", settings.upstream_api_key),
                                      ("MEMPROXY_ANTHROPIC_API_KEY", settings.anthropic_api_key))
             if value]
    named += [f"the api_key of route {route.match!r}" for route in settings.routes if route.api_key]
    return named


def open_relay(settings: Settings) -> bool:
    """Whether anyone who reaches the port may spend the operator's upstream key: bound
    beyond loopback, an upstream key, and requests served without a proxy key."""
    return (not settings.keys_required and beyond_loopback(settings.host)
            and bool(upstream_keys(settings)))


def start_refusal(settings: Settings) -> str | None:
    """Why `memproxy serve` must not start with `settings`, or None."""
    if not open_relay(settings) or settings.open_relay:
        return None
    return (f"refusing to start an open relay: bound to {settings.host} with"
            f" {' and '.join(upstream_keys(settings))} and no proxy keys, anyone who reaches"
            f" port {settings.port} would chat on that key. Set MEMPROXY_API_KEYS (or"
            " MEMPROXY_AUTH=keys with stored keys), bind MEMPROXY_HOST=127.0.0.1, or set"
            " MEMPROXY_OPEN_RELAY=on if the relay is intended")


def auth_mode(settings: Settings) -> str:
    """How callers are told apart, in a few words."""
    if settings.api_keys:
        return "keys (MEMPROXY_API_KEYS and stored keys)"
    if settings.auth == "keys":
        return "keys (stored keys)"
    admin = ", admin key for the admin and memory APIs" if settings.admin_key else ""
    return f"no keys required (stored keys when sent{admin})"


def warnings(settings: Settings) -> list[str]:
    """What the ready line warns about: configurations that work, but not as one expects."""
    found = []
    remote = beyond_loopback(settings.host)
    if open_relay(settings):
        found.append(f"open relay: anyone who reaches {settings.host}:{settings.port} chats on"
                     f" {' and '.join(upstream_keys(settings))} (MEMPROXY_OPEN_RELAY=on)")
    if remote and not settings.keys_required and not settings.management_remote:
        found.append(f"bound to {settings.host} without proxy keys: memory is off for every"
                     " client not on this machine (set MEMPROXY_API_KEYS, or"
                     " MEMPROXY_MANAGEMENT_REMOTE=on to open memory to all of them)")
    if settings.keys_required and not settings.upstream_api_key:
        found.append("proxy keys are required but MEMPROXY_UPSTREAM_API_KEY is unset: chats"
                     " reach the upstream with no Authorization header (a client's key is"
                     " memproxy's own, never forwarded)")
    return found


def describe(settings: Settings, *, tracing: bool) -> dict[str, Any]:
    """The ready line's account of access and routing."""
    anthropic = settings.anthropic_base_url or "via litellm on the model's route"
    return {
        "auth": auth_mode(settings),
        "tracing": "on" if tracing else "off",
        "anthropic_upstream": anthropic,
        "routes": [route.match for route in settings.routes],
    }
