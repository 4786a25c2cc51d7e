"""Who an MCP request is for: the caller /mcp authorised (proxy/mcp/server.py), carried in
the request's ASGI scope to the handlers, plus the client's name for provenance: its client
info (initialize's, or the request's _meta), else the HTTP User-Agent, since on the 2025
protocol a stateless server never sees initialize's client info with a later call."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import CLIENT_INFO_META_KEY, INVALID_PARAMS
from starlette.requests import Request

from proxy.management.access import Caller

CALLER = "memproxy.mcp.caller"  # the scope key the authorised caller rides under
MAX_CLIENT_NAME = 100  # memory.learning.fact_model.MAX_CLIENT_CHARS
# `memproxy mcp` (proxy/mcp/stdio.py) names the local client it forwards for under this
# request _meta key, since its own client info names the bridge. Like the client info, it
# is the client's own word: provenance, never identity.
FORWARDED_CLIENT_META_KEY = "dev.memproxy/client"


def caller_of(ctx: ServerRequestContext[Any]) -> Caller:
    """The caller `McpEndpoint` authorised, with the client's name for provenance."""
    request = ctx.request
    who = request.scope.get(CALLER) if isinstance(request, Request) else None
    if not isinstance(who, Caller):
        raise MCPError(INVALID_PARAMS, "no authorised caller for this request")
    # The name a forwarding bridge passed on, else the client's own.
    name = (ctx.meta or {}).get(FORWARDED_CLIENT_META_KEY)
    name = client_name(local_client(ctx) if name is None else name)
    return who if name is None else dataclasses.replace(who, client=name)


def client_name(name: object) -> str | None:
    """A client's name fit to record: printable text, cut to MAX_CLIENT_NAME."""
    if not isinstance(name, str) or not name or not name.isprintable():
        return None
    return name[:MAX_CLIENT_NAME]


def local_client(ctx: ServerRequestContext[Any]) -> str | None:
    """The client's name from initialize's client info, or from the request's _meta on
    protocols without initialize (a bridge's own client info names only the bridge)."""
    params = ctx.session.client_params
    if params is not None:
        return params.client_info.name
    info = (ctx.meta or {}).get(CLIENT_INFO_META_KEY)
    name = info.get("name") if isinstance(info, Mapping) else None
    return name if isinstance(name, str) else None
