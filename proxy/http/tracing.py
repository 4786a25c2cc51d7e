"""OpenTelemetry traces of memproxy's requests (docs/tracing.md), through the API only.

One span per HTTP request: a SERVER span that continues the client's trace (read with the
configured propagator, OTEL_PROPAGATORS), or, under the SERVER span of an ASGI
instrumentation that runs around memproxy, an INTERNAL child of it. Its steps' spans come
from memory/tracing.py and proxy/upstream/genai_span.py. Which provider records them is
decided once at start-up (proxy/http/telemetry.py); with none, the API's tracers are no-ops.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CAPTURE_CONTENT", "TRACING_STATE", "UNTRACED", "Span", "Tracing", "TracingMiddleware",
           "upstream_headers"]

TRACING_STATE = "memproxy.tracing"  # the lifespan state key of the app's Tracing
CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# Probes: a load balancer asks every few seconds, and a span each would outnumber the
# requests worth tracing.
UNTRACED = frozenset({"/healthz", "/readyz", "/metrics"})
_tracer = trace.get_tracer(__name__)


@dataclass(frozen=True)
class Tracing:
    """What the app's spans need besides the API: whether message contents go on the GenAI
    spans (redacted as stored turns are, by `redact`)."""

    capture_content: bool
    redact: Callable[[str], str]

    @classmethod
    def from_env(cls, environ: Mapping[str, str], redact: Callable[[str], str]) -> Tracing:
        """Content capture as the GenAI instrumentations' variable asks (off by default)."""
        return cls(environ.get(CAPTURE_CONTENT, "").strip().lower() == "true", redact)

    @staticmethod
    def drops_children() -> bool:
        """Whether a span started now would be sampled out (under a span sampled out):
        its attributes would go nowhere."""
        return not trace.get_current_span().get_span_context().trace_flags.sampled

    @staticmethod
    def start_client(
        name: str, attributes: Mapping[str, Any] | None = None, *, start_ns: int | None = None,
    ) -> tuple[Span, dict[str, str] | None]:
        """A CLIENT span under the current one, not made current (it ends at the reply's
        last byte, after the handler returned), and the headers that carry it upstream."""
        span = _tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes,
                                  start_time=start_ns)
        return span, upstream_headers(trace.set_span_in_context(span))

    @staticmethod
    def fail(span: Span, exc: BaseException | None, *, error_type: str | None = None) -> None:
        """Mark `span` failed (by `exc`, or as `error_type`) and end it."""
        if exc is not None:
            span.record_exception(exc)
            code = getattr(exc, "code", None)
            error_type = code if isinstance(code, str) else type(exc).__qualname__
        span.set_attribute("error.type", error_type or "error")
        span.set_status(Status(StatusCode.ERROR))
        span.end()

    @staticmethod
    def log_ids() -> dict[str, str]:
        """The current span's trace and span ids for a log line ({} outside a span)."""
        found = trace.get_current_span().get_span_context()
        if not found.is_valid:
            return {}
        return {"trace_id": trace.format_trace_id(found.trace_id),
                "span_id": trace.format_span_id(found.span_id)}


def upstream_headers(context: Context | None = None) -> dict[str, str] | None:
    """What the configured propagator writes for `context` (the current one by default);
    None when it writes no W3C Trace Context: memproxy then takes no part in the trace and
    the client's headers go upstream as they came."""
    if "traceparent" not in propagate.get_global_textmap().fields:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context)
    return carrier


class TracingMiddleware:
    """Each HTTP request inside its span, once the lifespan found a provider (the app's
    Tracing in the lifespan state); outermost, so refused requests are traced too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED \
                or TRACING_STATE not in scope.get("state", {}):
            await self.app(scope, receive, send)
            return
        # The request runs inside its span (HTTP semantic conventions).
        method = scope["method"]
        attributes = {"http.request.method": method, "url.path": scope["path"],
                      "url.scheme": scope.get("scheme", "http")}
        if trace.get_current_span().get_span_context().is_valid:
            # An ASGI instrumentation's SERVER span is current: ours is a step of it.
            parent, kind = None, SpanKind.INTERNAL
        else:
            parent, kind = propagate.extract(_carrier(scope["headers"])), SpanKind.SERVER
        status = 0

        def send_status(message: Message) -> Awaitable[None]:  # no coroutine of its own a chunk
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

        base = scope.get("root_path", "")
        with _tracer.start_as_current_span(method, parent, kind, attributes=attributes) as span:
            try:
                await self.app(scope, receive, send_status)
            except BaseException as exc:
                span.set_attribute("error.type", type(exc).__qualname__)
                raise
            finally:
                if span.is_recording():  # sampled out: a span with nothing to say
                    _describe(span, scope, base, method, status)


def _describe(span: Span, scope: Scope, base: str, method: str, status: int) -> None:
    """What the request's span learned once the request ran: its route and status."""
    route = getattr(scope.get("route"), "path", None)
    if isinstance(route, str):
        route = scope.get("root_path", "")[len(base):] + route  # under a Mount
        span.set_attribute("http.route", route)
        span.update_name(f"{method} {route}")
    if status:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR))


def _carrier(headers: Any) -> dict[str, str]:
    """The request's headers that the configured propagator reads; a request with two
    `traceparent` headers has none (W3C Trace Context, 3.2)."""
    fields = propagate.get_global_textmap().fields
    found: dict[str, str] = {}
    for raw, value in headers:
        name = raw.decode("latin-1")
        if name in fields:
            if name == "traceparent" and name in found:
                return {key: text for key, text in found.items() if key != "traceparent"}
            # Repeated list headers (tracestate, baggage) are one list (RFC 9110 5.3).
            text = value.decode("latin-1")
            found[name] = f"{found[name]},{text}" if name in found else text
    return found
