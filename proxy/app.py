"""The app factory: routes, error handlers and a lifespan that owns every resource."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from config import Settings
from config.settings import describe_storage
from memory import Embedder, MemoryEngine, Redactor
from proxy.access import exposure
from proxy.access.decision import require_operator
from proxy.access.edge import EdgeGuard
from proxy.access.stored_keys import StoredKeys
from proxy.access.usage import UsageMeter
from proxy.flow.exchange import endpoint
from proxy.formats.chat import CHAT
from proxy.formats.messages import MESSAGES, count_message_tokens
from proxy.formats.passthrough import passthrough
from proxy.formats.responses import RESPONSES
from proxy.http import telemetry
from proxy.http.errors import (
    ProxyError,
    handle_http_exception,
    handle_proxy_error,
    handle_unexpected,
)
from proxy.http.logs import configure_logging, get_logger
from proxy.http.metrics import Metrics, metrics_endpoint
from proxy.http.relay import SHUTDOWN_STATE
from proxy.http.shutdown import Shutdown
from proxy.http.tracing import TRACING_STATE, Tracing, TracingMiddleware
from proxy.management import admin_routes
from proxy.management import routes as management_routes
from proxy.management.panel import panel_routes
from proxy.state import AppState
from proxy.upstream.client import Upstream
from proxy.upstream.embeddings import UpstreamEmbedder
from proxy.upstream.llm_client import LLMClient
from proxy.upstream.rerank import reranker

if TYPE_CHECKING:
    from proxy.mcp.server import McpEndpoint

log = get_logger("app")
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def create_app(
    settings: Settings, *, upstream: Upstream | None = None, memory: MemoryEngine | None = None,
    with_memory: bool = True, embedder: Embedder | None = None,
) -> Starlette:
    """Build the memproxy ASGI app; nothing is opened until the lifespan starts.

    `memory` injects an engine the caller owns; `with_memory=False` runs a pure gateway;
    `embedder` replaces the local model (tests share one loaded model).
    """

    mcp: McpEndpoint | None = None
    if settings.mcp:  # /mcp's app; the MCP SDK is imported only then
        from proxy.mcp.server import McpEndpoint

        mcp = McpEndpoint(settings.max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        configure_logging(settings.log_level, settings.log_format)
        state = AppState(settings, upstream or Upstream(settings), Metrics())
        app.state.memproxy = state
        # The global TracerProvider, or memproxy's own (proxy/http/telemetry.py).
        provider = telemetry.configure(os.environ)
        state.tracing = Tracing.from_env(os.environ, Redactor(settings.redact)) if provider.traced else None
        # Compaction reads context windows from litellm's model map.
        if any(route.provider for route in settings.routes) or settings.compact:
            import proxy.upstream.litellm_transport  # noqa: F401 - import now, not on the first request
        jobs_stop: asyncio.Task[None] | None = None
        mcp_run = contextlib.AsyncExitStack()  # the MCP SDK's task groups, while serving
        try:
            if memory is not None:
                state.memory = memory
            elif with_memory:
                chosen = embedder
                if chosen is None and settings.embedding_backend == "upstream":
                    chosen = UpstreamEmbedder(state.upstream, settings.embedding_upstream_model,
                                              tracing=state.tracing)
                state.llm = LLMClient(settings, state.upstream, state.tracing)
                state.memory = await MemoryEngine.open(
                    settings, embedder=chosen, llm=state.llm,
                    rerank=reranker(settings, state.upstream, state.llm),
                )
                # Jobs stop when the shutdown begins, while streams drain, not after them.
                jobs_stop = asyncio.get_running_loop().create_task(
                    _stop_jobs_at_shutdown(state.shutdown, state.memory)
                )
            if state.memory is not None:
                state.keys = StoredKeys(state.memory.keys)
                # Usage lives in the memory database; a gateway without one counts nothing.
                state.usage = UsageMeter(state.memory.usage,
                                         flush_seconds=settings.usage_flush_seconds)
                state.usage.start()
                state.limits.shared = state.memory.rates  # a key's rate on every replica
            if mcp is not None:
                await mcp_run.enter_async_context(mcp.run())
            app.state.ready = True
            learning = state.llm.readiness() if state.llm is not None else "off"
            # Quietly wrong configurations are said here, once (proxy/access/exposure.py).
            warnings = exposure.warnings(settings)
            if learning not in ("ok", "off"):
                warnings.append(f"learning cannot reach a model: {learning}")
            log.log(WARNING if warnings else INFO, "memproxy ready", extra={
                "upstream": settings.upstream_base_url, "data_dir": str(settings.data_dir),
                "memory": state.memory is not None, "learning": learning,
                **exposure.describe(settings, tracing=state.tracing is not None),
                **(describe_storage(settings) if state.memory is not None else {}),
                **({"warnings": warnings} if warnings else {}),
            })
            for warning in warnings:
                log.warning(warning)
            # Lifespan state: every request's scope carries the shutdown (proxy/http/relay.py)
            # and the tracing (proxy/http/tracing.py).
            yield {SHUTDOWN_STATE: state.shutdown, **({TRACING_STATE: state.tracing} if state.tracing else {})}
        finally:
            app.state.ready = False
            await mcp_run.aclose()
            state.shutdown.begin()  # a no-op when the server began it as the signal came
            await state.drain()
            if state.usage is not None:
                await state.usage.close()  # the last counts, streams drained
            if jobs_stop is not None:
                await jobs_stop
            if state.keys is not None:
                await state.keys.aclose()  # last-used times still pending
            if state.memory is not None and memory is None:
                await state.memory.close(state.shutdown.remaining())
            if upstream is None:
                await state.upstream.aclose()
            # litellm may have been imported since (a Messages request translated by it).
            if "proxy.upstream.litellm_transport" in sys.modules:
                from proxy.upstream.litellm_transport import close_clients

                await close_clients()
            # The last spans go out within the grace; a collector that is down costs no more.
            await provider.shutdown(min(5.0, state.shutdown.remaining()))

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/chat/completions", endpoint(CHAT), methods=["POST"]),
        # Other methods (GET/DELETE /v1/responses/{id}, ...) fall through to the pass-through.
        Route("/v1/responses", endpoint(RESPONSES), methods=["POST"]),
        Route("/v1/messages", endpoint(MESSAGES), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
        # The memory API is memproxy's own: it must match before the pass-through.
        Mount("/v1/memory", routes=management_routes()),
        # The admin API (docs/keys.md, docs/usage.md): the admin key only, before the
        # pass-through too.
        Mount("/v1/admin", routes=admin_routes()),
        *panel_routes(),
        Route("/v1/{path:path}", passthrough, methods=METHODS),
        *([Route("/mcp", mcp, methods=METHODS)] if mcp is not None else []),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        # Host, Origin and Content-Type, before any route reads a byte (proxy/access/edge.py).
        middleware=[
            Middleware(TracingMiddleware),  # outermost: refused requests are traced too
            Middleware(EdgeGuard, settings=settings,
                       envelopes={"/v1/messages": MESSAGES.error_response}),
        ],
        exception_handlers={
            ProxyError: handle_proxy_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
    )
    app.state.ready = False
    return app


def begin_shutdown(app: Starlette, at: float | None = None) -> None:
    """Start the app's shutdown clock at `at` (a time.monotonic() reading) or now: the
    server calls this as the signal arrives, so the grace counts from then."""
    state: AppState | None = getattr(app.state, "memproxy", None)
    if state is not None:
        state.shutdown.begin(at)


async def _stop_jobs_at_shutdown(shutdown: Shutdown, memory: MemoryEngine) -> None:
    await shutdown.begun.wait()
    await memory.stop_jobs(shutdown.until_cut())


async def healthz(request: Request) -> Response:
    """200 while the process serves."""
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    """Prometheus's text, for the operator (`require_operator`)."""
    require_operator(request, request.app.state.memproxy.settings)
    return await metrics_endpoint(request)


async def readyz(request: Request) -> Response:
    """200 once every dependency is open and answering, else 503; the parts (and what
    fails in them) only for the operator (`require_operator`), the status for any probe."""
    state: AppState | None = getattr(request.app.state, "memproxy", None)
    if state is None or not request.app.state.ready:
        return JSONResponse({"status": "starting"}, status_code=503)
    parts: dict[str, str] = {"upstream_client": "ok" if not state.upstream.client.closed else "closed"}
    if state.memory is not None:
        parts.update(await state.memory.health())
    ok = all(value == "ok" for value in parts.values())
    if state.llm is not None:
        # Said, not counted: a replica whose learning fails still serves every chat.
        parts["learning"] = state.llm.readiness()
    body: dict[str, Any] = {"status": "ok" if ok else "degraded"}
    # A probe gets the status; what fails, and where, is the operator's.
    with contextlib.suppress(ProxyError):
        require_operator(request, state.settings)
        body["parts"] = parts
    return JSONResponse(body, status_code=200 if ok else 503)
