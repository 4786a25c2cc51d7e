"""Who an MCP request is for: the caller /mcp authorised (proxy/mcp/server.py), carried in
the request's ASGI scope to the handlers, plus the client's name for provenance."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import CLIENT_INFO_META_KEY, INVALID_PARAMS
from starlette.requests import Request

from config import Settings
from memory import MemoryEngine
from proxy.access.decision import Principal

CALLER = "memproxy.mcp.caller"  # the scope key the authorised caller rides under
MAX_CLIENT_NAME = 100


@dataclass(frozen=True)
class McpCaller:
    """An authorised /mcp request: who asks, whose memory, and through which client."""

    principal: Principal
    user_id: str
    org_id: str | None
    session_id: str | None
    memory: MemoryEngine
    settings: Settings
    limit_keys: tuple[str, ...] = ()  # the rate-limit buckets the request counts against
    client: str | None = None  # the client's name from initialize or the request's _meta

    def with_client(self, name: str) -> McpCaller:
        """The same caller, naming its client."""
        return dataclasses.replace(self, client=name)


def caller_of(ctx: ServerRequestContext[Any]) -> McpCaller:
    """The caller `McpEndpoint` authorised, with the client's name for provenance."""
    request = ctx.request
    who = request.scope.get(CALLER) if isinstance(request, Request) else None
    if not isinstance(who, McpCaller):
        raise MCPError(INVALID_PARAMS, "no authorised caller for this request")
    name = _client_name(ctx)
    return who if name is None else who.with_client(name)


def _client_name(ctx: ServerRequestContext[Any]) -> str | None:
    params = ctx.session.client_params
    name = params.client_info.name if params is not None else None
    if name is None and ctx.meta is not None:
        info = ctx.meta.get(CLIENT_INFO_META_KEY)
        name = info.get("name") if isinstance(info, Mapping) else None
    if not isinstance(name, str) or not name.isprintable():
        return None
    return name[:MAX_CLIENT_NAME]
