"""MCP resources: the caller's profile and a session's summary, read like the tools read
them (proxy/mcp/tools.py), for the caller the HTTP request authorised."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import mcp_types as types
import orjson
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from proxy.access.identity import MAX_ID_LENGTH
from proxy.http.errors import ProxyError
from proxy.mcp.caller import caller_of
from proxy.mcp.schemas import PROFILE_URI, NoArguments
from proxy.mcp.tools import read_profile, session_summary

RESOURCE_NOT_FOUND = -32002  # MCP 2025-06-18 "Resources", error handling
SESSION_PREFIX = "memproxy://sessions/"
SUMMARY_SUFFIX = "/summary"


async def read_resource(
    ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
) -> types.ReadResourceResult:
    """The profile as JSON, or a session's current summary as text."""
    uri = params.uri
    who = caller_of(ctx)
    try:
        if uri == PROFILE_URI:
            body = orjson.dumps(await read_profile(who, NoArguments())).decode()
            return _contents(uri, body, "application/json")
        if uri.startswith(SESSION_PREFIX) and uri.endswith(SUMMARY_SUFFIX):
            session_id = unquote(uri[len(SESSION_PREFIX):-len(SUMMARY_SUFFIX)])
            if not session_id or len(session_id) > MAX_ID_LENGTH:
                raise MCPError(INVALID_PARAMS, "a session id is 1 to 256 characters")
            summary = await session_summary(who, session_id)
            if summary is None:
                raise MCPError(RESOURCE_NOT_FOUND, "this session has no summary yet")
            return _contents(uri, summary, "text/plain")
    except ProxyError as exc:
        raise MCPError(INVALID_PARAMS, exc.message) from None
    raise MCPError(RESOURCE_NOT_FOUND, "no such resource")


def _contents(uri: str, text: str, mime_type: str) -> types.ReadResourceResult:
    return types.ReadResourceResult(
        contents=[types.TextResourceContents(uri=uri, text=text, mime_type=mime_type)]
    )
