"""`memproxy mcp`: MCP on stdin/stdout for clients that only start local processes, every
message forwarded to a running memproxy's /mcp, so that server stays the only writer.

The bridge is an MCP server on stdio whose handlers call an MCP client connected to the
running server over Streamable HTTP; identity is the key (and X-Memory-* headers) this
command sends, never anything the local client says.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, cast

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from proxy.mcp.caller import FORWARDED_CLIENT_META_KEY, local_client

DEFAULT_URL = "http://127.0.0.1:8080"
CLIENT_NAME = "memproxy-mcp-stdio"
TIMEOUT = httpx2.Timeout(30.0, read=300.0)


def run(args: argparse.Namespace) -> int:
    """Serve until stdin closes; 1 when the server cannot be reached."""
    url = (args.url or os.environ.get("MEMPROXY_URL") or DEFAULT_URL).rstrip("/")
    key = args.key or os.environ.get("MEMPROXY_KEY")
    if not key and os.environ.get("MEMPROXY_API_KEY"):
        # The name this command read before the others' MEMPROXY_KEY; still read, for now.
        key = os.environ["MEMPROXY_API_KEY"]
        print("memproxy mcp: warning: MEMPROXY_API_KEY is deprecated, name the key"
              " MEMPROXY_KEY as the other commands do", file=sys.stderr)
    headers = {name: value for name, value in (
        ("Authorization", f"Bearer {key}" if key else None),
        ("X-Memory-User-Id", args.user), ("X-Memory-Session-Id", args.session),
    ) if value}
    # The SDK logs what it could not parse with a traceback; the failure is said once, below.
    logging.getLogger("mcp").setLevel(logging.CRITICAL)
    try:
        anyio.run(bridge, f"{url}/mcp", headers)
    except Exception as exc:  # the SDK's task groups wrap the reason in ExceptionGroups
        print(f"memproxy mcp: {why_not(url, headers, exc)}", file=sys.stderr)
        return 1
    return 0


def why_not(url: str, headers: Mapping[str, str], exc: Exception) -> str:
    """One line for a bridge that could not start: what the server at `url` answered, or
    why it could not be reached, and what to change."""
    reasons = list(_leaves(exc))
    unreachable = [e for e in reasons if isinstance(e, (OSError, httpx2.TransportError))]
    if unreachable:
        return (f"cannot reach memproxy at {url} ({unreachable[0]}): is it running there?"
                " Check --url (MEMPROXY_URL)")
    # The MCP client says only "Server returned an error response": ask once more, plainly,
    # to read the status and the server's own message.
    try:
        answer = httpx2.post(f"{url}/mcp", headers={**headers, **_PLAIN}, json=_PING,
                             timeout=TIMEOUT)
    except httpx2.HTTPError as probe:
        return f"cannot reach memproxy at {url} ({probe}): check --url (MEMPROXY_URL)"
    fix = _FIXES.get(answer.status_code, "")
    if url.endswith(("/v1", "/mcp")):  # memproxy relays /v1/* upstream: any answer may come
        fix = _FIXES[404]
    if not answer.is_error:
        first = str(getattr(reasons[0], "message", reasons[0])) if reasons else str(exc)
        return f"{url}/mcp failed: {(first.splitlines() or [''])[0][:200]}{fix}"
    return f"{url}/mcp answered {answer.status_code} {_message(answer)}{fix}"


_PLAIN = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
_PING = {"jsonrpc": "2.0", "id": 0, "method": "ping"}
_FIXES = {
    401: "; give a proxy key with --key or MEMPROXY_KEY",
    403: "; this key may not use that memory: check --key and --user",
    404: "; --url (MEMPROXY_URL) is memproxy's own address, without /v1 or /mcp",
}


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _message(answer: httpx2.Response) -> str:
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.reason_phrase


async def bridge(url: str, headers: Mapping[str, str]) -> None:
    """Connect to `url`, then serve stdio with every request forwarded there."""
    async with (
        httpx2.AsyncClient(headers=dict(headers), timeout=TIMEOUT) as http,
        Client(streamable_http_client(url, http_client=http),
               client_info=types.Implementation(name=CLIENT_NAME, version="1")) as remote,
        stdio_server() as (read, write),
    ):
        server = forwarding_server(remote)
        await server.run(read, write, server.create_initialization_options())


def forwarding_server(remote: Client) -> Server[Any]:
    """A server whose every tool and resource is the remote server's."""

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        name = local_client(ctx)
        meta: dict[str, Any] = {} if name is None else {FORWARDED_CLIENT_META_KEY: name}
        return await remote.call_tool(
            params.name, params.arguments, meta=cast(types.RequestParamsMeta, meta)
        )

    server: Server[Any] = Server(
        "memproxy", version="1", title="memproxy memory (stdio)",
        instructions=remote.instructions,
        on_list_tools=lambda ctx, params: remote.list_tools(),
        on_call_tool=call_tool,
        on_list_resources=lambda ctx, params: remote.list_resources(),
        on_list_resource_templates=lambda ctx, params: remote.list_resource_templates(),
        on_read_resource=lambda ctx, params: remote.read_resource(params.uri),
    )
    server.middleware = []
    return server
