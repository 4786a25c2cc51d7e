"""OpenTelemetry traces (docs/tracing.md): one SERVER span per request, continuing the
client's W3C `traceparent`, and the spans of its steps, exported over OTLP/HTTP in batches.

The only module that imports OpenTelemetry, and only imported when
OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (proxy/app.py):
off, no request pays for tracing, not even the import. Only the SDK's own OTEL_* variables
configure it (service name, resource attributes, headers, sampler, batch delay, timeouts).

Each app holds its own TracerProvider instead of the process-wide one: litellm's and
Chroma's OpenTelemetry callbacks set the global provider when they are configured, and the
tests build many apps in one process; neither can clobber the other this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memory import activate_tracer, deactivate_tracer

TRACING_STATE = "memproxy.tracing"  # the lifespan state key of the app's Tracing
# The W3C Trace Context headers (https://www.w3.org/TR/trace-context/): the client's are
# read here and never forwarded; the upstream gets memproxy's own CLIENT span's.
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
_TRACE_HEADER_BYTES = frozenset(name.encode() for name in TRACE_HEADERS)
CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_PROPAGATOR = TraceContextTextMapPropagator()
_NOTHING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
Span = trace.Span


class Tracing:
    """The app's tracer, its batch exporter, and the spans memproxy opens."""

    def __init__(self, provider: TracerProvider, processor: BatchSpanProcessor, *,
                 capture: bool, redact: Callable[[str], str]) -> None:
        self.provider = provider
        self.processor = processor
        self.tracer = provider.get_tracer("memproxy")
        # Message contents on the GenAI spans, redacted as stored turns are: only when asked.
        self.capture_content = capture
        self.redact = redact

    @classmethod
    def from_env(cls, redact: Callable[[str], str]) -> Tracing:
        """A provider configured by the OTEL_* variables, exporting OTLP/HTTP in batches."""
        detected = OTELResourceDetector().detect()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        own: dict[str, str] = {} if SERVICE_NAME in detected.attributes else {SERVICE_NAME: "memproxy"}
        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG) inside TracerProvider.
        # shutdown_on_exit=False: the lifespan shuts it down, bounded (an atexit hook would
        # wait for a collector that is down).
        provider = TracerProvider(resource=Resource.create(own), shutdown_on_exit=False)
        processor = BatchSpanProcessor(OTLPSpanExporter())  # OTEL_BSP_*, OTEL_EXPORTER_OTLP_*
        provider.add_span_processor(processor)
        capture = os.environ.get(CAPTURE_CONTENT, "").strip().lower() == "true"
        return cls(provider, processor, capture=capture, redact=redact)

    async def shutdown(self, timeout: float) -> None:
        """Export what is left, waiting up to `timeout` seconds: a collector that is down or
        slow costs the shutdown no more (the export goes on in a daemon thread, which the
        process does not wait for at exit)."""
        stopping = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        stopping.start()
        await asyncio.to_thread(stopping.join, timeout)

    # -- memory's Tracer (memory/tracing.py)

    def span(
        self, name: str, attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Span | None]:
        """An INTERNAL child of the current span, current while open; nothing (None) under a
        span sampled out, whose children would be too (work after a response goes on under
        the request's span after it ended, so its sampled flag decides, not is_recording)."""
        if not _sampled():
            return _NOTHING
        return self.tracer.start_as_current_span(name, attributes=attributes)

    def linked(
        self, name: str, links: Sequence[str], attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Span]:
        """A CONSUMER span that starts a trace of its own, linked to the spans in `links`
        (W3C traceparents): a background job and the requests that queued it."""
        found = [Link(context) for parent in links if (context := span_context(parent)) is not None]
        return self.tracer.start_as_current_span(
            name, context=otel_context.Context(), kind=SpanKind.CONSUMER, links=found,
            attributes=attributes,
        )

    def traceparent(self) -> str | None:
        """The current span's traceparent (None when it was sampled out: no link to make)."""
        if not _sampled():
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier.get("traceparent")

    def current_headers(self) -> dict[str, str]:
        """The Trace Context headers of the current span (a pass-through request's SERVER
        span), for the upstream to continue."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier

    # -- the upstream call's CLIENT span (proxy/upstream/genai_span.py)

    def start_client(self, name: str) -> tuple[Span, dict[str, str]]:
        """A CLIENT span under the current one, not made current (it ends at the reply's
        last byte, after the handler returned), and the headers that carry it upstream."""
        span = self.tracer.start_span(name, kind=SpanKind.CLIENT)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return span, carrier

    def fail(self, span: Span, exc: BaseException | None, *, error_type: str | None = None) -> None:
        """Mark `span` failed (by `exc`, or as `error_type`) and end it."""
        if exc is not None:
            span.record_exception(exc)
            code = getattr(exc, "code", None)
            error_type = code if isinstance(code, str) else type(exc).__qualname__
        span.set_attribute("error.type", error_type or "error")
        span.set_status(Status(StatusCode.ERROR))
        span.end()

    def log_ids(self) -> dict[str, str]:
        """The current span's trace and span ids for a log line ({} outside a span)."""
        found = trace.get_current_span().get_span_context()
        if not found.is_valid:
            return {}
        return {"trace_id": trace.format_trace_id(found.trace_id),
                "span_id": trace.format_span_id(found.span_id)}

    # -- the SERVER span

    async def serve(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one HTTP request inside its SERVER span (HTTP semantic conventions)."""
        parent = _PROPAGATOR.extract(_trace_headers(scope["headers"]))
        method = scope["method"]
        span = self.tracer.start_span(method, context=parent, kind=SpanKind.SERVER)
        if span.is_recording():  # sampled out: a span with nothing to say, at little cost
            span.set_attributes({"http.request.method": method, "url.path": scope["path"],
                                 "url.scheme": scope.get("scheme", "http")})
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        base = scope.get("root_path", "")
        attached = otel_context.attach(trace.set_span_in_context(span, parent))
        active = activate_tracer(self)
        try:
            await app(scope, receive, send_status)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_attributes({"error.type": type(exc).__qualname__})
            span.set_status(Status(StatusCode.ERROR))
            raise
        finally:
            deactivate_tracer(active)
            otel_context.detach(attached)
            route = getattr(scope.get("route"), "path", None) if span.is_recording() else None
            if isinstance(route, str):
                route = scope.get("root_path", "")[len(base):] + route  # under a Mount
                span.set_attribute("http.route", route)
                span.update_name(f"{method} {route}")
            if status and span.is_recording():
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_attributes({"error.type": str(status)})
                    span.set_status(Status(StatusCode.ERROR))
            span.end()


class TracingMiddleware:
    """Each HTTP request inside a SERVER span, once the lifespan opened the app's tracing
    (installed only when tracing is on)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing = scope.get("state", {}).get(TRACING_STATE) if scope["type"] == "http" else None
        if tracing is None:
            await self.app(scope, receive, send)
            return
        await tracing.serve(self.app, scope, receive, send)


def span_context(traceparent: str) -> trace.SpanContext | None:
    """The span a W3C traceparent names, None when it names none validly."""
    context = _PROPAGATOR.extract({"traceparent": traceparent})
    found = trace.get_current_span(context).get_span_context()
    return found if found.is_valid else None


def _sampled() -> bool:
    """Whether the current span (ended or not) is sampled."""
    return trace.get_current_span().get_span_context().trace_flags.sampled


def _trace_headers(headers: Any) -> dict[str, str]:
    """The request's Trace Context headers (the propagator reads nothing else); a request
    with two `traceparent` headers has none (W3C Trace Context, 3.2)."""
    found: dict[str, str] = {}
    for name, value in headers:
        if name in _TRACE_HEADER_BYTES:
            key = name.decode()
            # Repeated tracestate headers are one list (RFC 9110 5.3).
            found[key] = f"{found[key]},{value.decode('latin-1')}" if key in found \
                else value.decode("latin-1")
            if key == "traceparent" and "," in found[key]:
                return {}
    return found

