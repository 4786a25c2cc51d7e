"""/mcp: the Model Context Protocol over Streamable HTTP (MCP 2025-06-18 "Transports"),
stateless, on the official `mcp` SDK's low-level server and session manager.

Stateless means no session lives in this process: every POST carries one JSON-RPC message
and is answered in full, so any replica behind a round-robin balancer answers any request.
The answer is JSON or an SSE stream as the client's Accept asks (text/event-stream listed:
SSE; else JSON); GET and DELETE, which only sessions use, get 405.

Before the SDK sees a request, `McpEndpoint` does what /v1/memory does (proxy/access/decision.py):
the key and X-Memory-* headers name the caller and the memory (401/403 at the HTTP level),
the body is read within the size limit (413), and the caller rides in the request's scope
to the tool handlers, which never take identity from arguments.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, TypeVar

import mcp_types as types
import orjson
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from memory import ConsentRequired, CursorError, FactError, RequestMetrics
from proxy.http.body import read_body
from proxy.http.errors import ProxyError
from proxy.http.logs import get_logger
from proxy.management.access import Caller, authorise
from proxy.mcp.caller import CALLER, caller_of, client_name
from proxy.mcp.resources import read_resource
from proxy.mcp.schemas import RESOURCES, TEMPLATES, TOOLS
from proxy.mcp.tools import HANDLERS, arguments
from proxy.state import AppState

log = get_logger("mcp")
ROUTE = "/mcp"
MAX_BODY_BYTES = 1024 * 1024  # a tool call is a few kB; the memory API's limits are smaller
_Result = TypeVar("_Result")


class McpEndpoint:
    """The /mcp ASGI app; `run()` must be entered for the app's lifespan."""

    def __init__(self, body_limit: int) -> None:
        self.server = build_server()
        self.body_limit = min(body_limit, MAX_BODY_BYTES)
        # The SDK's own checks (Accept, Content-Type, the JSON-RPC envelope) stay on; the
        # size limit is ours (a JSON 413, before the SDK reads anything).
        self.json, self.sse = (
            StreamableHTTPSessionManager(self.server, json_response=json_response, stateless=True,
                                         max_request_body_size=self.body_limit + 1)
            for json_response in (True, False)
        )

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """The task groups the SDK runs each request's server in."""
        async with self.json.run(), self.sse.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        request = Request(scope, receive)
        state: AppState = request.app.state.memproxy
        try:
            if scope.get("method") != "POST":
                response = Response(status_code=405, headers={"Allow": "POST"})
                await response(scope, receive, watch)
                return
            who = await authorise(request, tools=True)
            scope[CALLER] = replace(who, client=client_name(request.headers.get("user-agent")))
            body = await read_body(request, self.body_limit)
        except ProxyError as exc:
            await exc.to_response()(scope, receive, watch)
            return
        finally:
            if status:
                state.metrics.observe(ROUTE, status, time.perf_counter() - started)
        accept = request.headers.get("accept", "")
        manager = self.sse if "text/event-stream" in accept else self.json
        try:
            await manager.handle_request(scope, replay(body, receive), watch)
        finally:
            state.metrics.observe(ROUTE, status or 499, time.perf_counter() - started)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands over the body already read, then the client's own messages (an
    SSE answer watches them for the disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def build_server() -> Server[Any]:
    """The low-level MCP server: memproxy's tools and resources."""
    server: Server[Any] = Server(
        "memproxy", version="1", title="memproxy memory",
        instructions=(
            "Long-term memory shared with every AI app that goes through memproxy. Search it "
            "before answering from the user's history; save durable facts with add_memory."
        ),
        # Every tool, resource and template in one page.
        on_list_tools=lambda ctx, params: _answer(types.ListToolsResult(tools=list(TOOLS.values()))),
        on_call_tool=call_tool,
        on_list_resources=lambda ctx, params: _answer(
            types.ListResourcesResult(resources=RESOURCES)),
        on_list_resource_templates=lambda ctx, params: _answer(
            types.ListResourceTemplatesResult(resource_templates=TEMPLATES)),
        on_read_resource=read_resource,
    )
    server.middleware = []  # no OpenTelemetry span per message: nothing here exports them
    return server


async def _answer(result: _Result) -> _Result:
    # The SDK awaits every handler; a listing has nothing to wait for.
    return result


async def call_tool(
    ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
) -> types.CallToolResult:
    """Run one tool for the request's caller; a failure it can explain is an error result."""
    handler = HANDLERS.get(params.name)
    if handler is None:
        raise MCPError(INVALID_PARAMS, f"unknown tool {params.name[:100]!r}")
    who = caller_of(ctx)
    state: AppState = ctx.request.app.state.memproxy  # type: ignore[union-attr]
    started = time.perf_counter()
    outcome, result = "ok", None
    try:
        result = await handler(who, arguments(params.name, params.arguments))
        return types.CallToolResult(
            content=[types.TextContent(text=orjson.dumps(result).decode())], structured_content=result
        )
    except (ProxyError, FactError, ConsentRequired, CursorError) as exc:
        outcome = type(exc).__name__
        # A ProxyError's str() is its message.
        return types.CallToolResult(content=[types.TextContent(text=str(exc))], is_error=True)
    finally:
        _account(state, who, params.name, outcome, result, time.perf_counter() - started)


def _account(
    state: AppState, who: Caller, tool: str, outcome: str, result: dict[str, Any] | None,
    seconds: float,
) -> None:
    """Count the call, log it, and keep a metrics row after the response."""
    state.metrics.mcp_calls.labels(tool, "ok" if outcome == "ok" else "error").inc()
    log.info("mcp tool call", extra={
        "tool": tool, "outcome": outcome, "client": who.client, "ms": round(seconds * 1000, 2),
    })
    items = result.get("items") if isinstance(result, dict) and tool == "search_memory" else None
    state.spawn(who.memory.record(RequestMetrics(
        user_id=who.user_id, session_id=who.session_id, model=f"mcp:{tool}",
        items=Counter(item["kind"] for item in items) if items else {},
        injected_tokens=int(result.get("tokens", 0)) if items is not None and result else 0,
        recall_ms=round(seconds * 1000, 3),
        error=None if outcome == "ok" else outcome,
    )))
