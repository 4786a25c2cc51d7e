"""OpenTelemetry traces (docs/tracing.md): one SERVER span per request, continuing the
client's W3C `traceparent`, and the spans of its steps, exported over OTLP/HTTP in batches.

With recorded_span.py (the spans) and otlp_export.py (the exporter), the only modules that
import OpenTelemetry, and only imported when OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (proxy/app.py): off, no request pays for tracing,
not even the import. Only the SDK's own OTEL_* variables configure it (service name,
resource attributes, headers, sampler, batch delay, timeouts, OTEL_PROPAGATORS).

Each app holds its own TracerProvider instead of the process-wide one: litellm's and
Chroma's OpenTelemetry callbacks set the global provider when they are configured, and the
tests build many apps in one process; neither can clobber the other this way.

A span costs CPU on every request (docs/tracing.md#what-it-costs), so what wraps it here is
kept thin: spans come from a SpanMaker instead of the SDK's Tracer, attributes go in one
dict at the span's start, a step's span makes itself current in its own `with` block
instead of through the SDK's two generator context managers, and the `traceparent` going
upstream is formatted from the span's context instead of through a propagator and a carrier.

memproxy's current span is its own context variable, `CURRENT` (recorded_span.py), holding
the span's `SpanContext`: making a span current costs a `ContextVar.set` and a `reset`, where the
OpenTelemetry context costs a dict copy, an attach and a detach through the runtime context
(about 3.5 µs a span), and every reader here (a child's parent, `traceparent()`,
`current_headers()`, `log_ids()`) reads it in one call. A context variable travels as
OpenTelemetry's does: copied into each task a request starts, so work after the response
(remember.reply, a job queued) still has the request's span, sampled in or out. Only the
roots, the SERVER span of a request and the CONSUMER span of a job, are also made current
in the OpenTelemetry context, once each: an instrumentation of another library (litellm's
OpenTelemetry callback, say) then parents its spans under the request or the job, as
before, though not under memproxy's steps in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import Token
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import DEFAULT_TRACE_STATE
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memory import activate_tracer, deactivate_tracer
from proxy.http.logs import get_logger
from proxy.http.otlp_export import FastOTLPSpanExporter
from proxy.http.recorded_span import CURRENT, RecordedSpan, SpanMaker, failed

TRACING_STATE = "memproxy.tracing"  # the lifespan state key of the app's Tracing
# The W3C Trace Context headers (https://www.w3.org/TR/trace-context/): the client's are
# read here and never forwarded; the upstream gets memproxy's own CLIENT span's.
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
_TRACE_HEADER_BYTES = frozenset(name.encode() for name in TRACE_HEADERS)
CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# OTEL_PROPAGATORS names memproxy speaks: W3C Trace Context, read and written; W3C Baggage,
# which it never reads nor changes (the header goes upstream as any other does); none.
PROPAGATORS = ("tracecontext", "baggage", "none")
_PROPAGATOR = TraceContextTextMapPropagator()
_NOTHING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
_ROOT = otel_context.Context()  # no parent: a trace of its own
Span = trace.Span
_SAMPLED = TraceFlags.SAMPLED
log = get_logger("tracing")


class Tracing:
    """The app's tracer, its batch exporter, and the spans memproxy opens."""

    def __init__(self, provider: TracerProvider, processor: BatchSpanProcessor, *,
                 capture: bool, redact: Callable[[str], str], propagate: bool = True) -> None:
        self.provider = provider
        self.processor = processor
        self.spans = SpanMaker(provider, processor, "memproxy")
        # Message contents on the GenAI spans, redacted as stored turns are: only when asked.
        self.capture_content = capture
        self.redact = redact
        # W3C Trace Context in (the client's) and out (to the upstream): OTEL_PROPAGATORS.
        self.propagate = propagate

    @classmethod
    def from_env(cls, redact: Callable[[str], str]) -> Tracing:
        """A provider configured by the OTEL_* variables, exporting OTLP/HTTP in batches."""
        detected = OTELResourceDetector().detect()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        own: dict[str, str] = {} if SERVICE_NAME in detected.attributes else {SERVICE_NAME: "memproxy"}
        # The sampler comes from OTEL_TRACES_SAMPLER(_ARG) inside TracerProvider.
        # shutdown_on_exit=False: the lifespan shuts it down, bounded (an atexit hook would
        # wait for a collector that is down).
        resource = _SettledResource.of(Resource.create(own))
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        processor = BatchSpanProcessor(FastOTLPSpanExporter())  # OTEL_BSP_*, OTEL_EXPORTER_OTLP_*
        provider.add_span_processor(processor)
        capture = os.environ.get(CAPTURE_CONTENT, "").strip().lower() == "true"
        propagate = propagates_trace_context(os.environ.get("OTEL_PROPAGATORS", ""))
        return cls(provider, processor, capture=capture, redact=redact, propagate=propagate)

    @staticmethod
    def freeze_startup_heap() -> None:
        """Leave what start-up made out of the garbage collector's full collections, once
        memproxy is ready. Spans wait in the batch exporter's queue (up to 5 s), long enough
        to reach the oldest generation, and so make full collections several times as
        frequent; each walks the whole start-up heap (the embedding model, Chroma, litellm:
        about 90 ms on the benchmark machine) unless that heap is frozen (docs/tracing.md)."""
        gc.collect()  # not to freeze garbage with it
        gc.freeze()

    async def shutdown(self, timeout: float) -> None:
        """Export what is left, waiting up to `timeout` seconds: a collector that is down or
        slow costs the shutdown no more (the export goes on in a daemon thread, which the
        process does not wait for at exit). Unfreezes the start-up heap."""
        gc.unfreeze()
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
        parent = CURRENT.get()
        if parent is None or not parent[3] & _SAMPLED:  # its trace_flags, without the property
            return _NOTHING
        span = self.spans.child(name, parent, attributes)
        # A RecordedSpan is current while its `with` block runs; what a sampler decided
        # otherwise (a remote parent's child) is made so.
        return span if type(span) is RecordedSpan else _Current(span)

    def linked(
        self, name: str, links: Sequence[str], attributes: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Span]:
        """A CONSUMER span that starts a trace of its own, linked to the spans in `links`
        (W3C traceparents): a background job and the requests that queued it."""
        found = [Link(context) for parent in links if (context := span_context(parent)) is not None]
        return _Current(self.spans.begin(name, None, SpanKind.CONSUMER, attributes, found, context=_ROOT),
                        root=True)

    def traceparent(self) -> str | None:
        """The current span's traceparent (None when it was sampled out: no link to make)."""
        found = CURRENT.get()
        return traceparent(found) if found is not None and found.trace_flags & TraceFlags.SAMPLED else None

    def current_headers(self) -> dict[str, str] | None:
        """The Trace Context headers of the current span (a pass-through request's SERVER
        span), for the upstream to continue; None when memproxy propagates none (then the
        client's go upstream as they came)."""
        if not self.propagate:
            return None
        found = CURRENT.get()
        return _headers(found) if found is not None else {}

    # -- the upstream call's CLIENT span (proxy/upstream/genai_span.py)

    def drops_children(self) -> bool:
        """Whether a span started under the current one is sampled out without asking the
        sampler: its attributes would go nowhere."""
        return self.spans.drops_child_of(CURRENT.get())

    def start_client(
        self, name: str, attributes: Mapping[str, Any] | None = None, *, start_ns: int | None = None,
    ) -> tuple[Span, dict[str, str] | None]:
        """A CLIENT span under the current one, not made current (it ends at the reply's
        last byte, after the handler returned), and the headers that carry it upstream
        (None when memproxy propagates none)."""
        span = self.spans.begin(name, CURRENT.get(), SpanKind.CLIENT, attributes, start_ns=start_ns)
        return span, _headers(span.get_span_context()) if self.propagate else None

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
        found = CURRENT.get()
        if found is None:
            return {}
        trace_id, span_id, _, _, _, valid = found  # the fields, without their properties
        return {"trace_id": f"{trace_id:032x}", "span_id": f"{span_id:016x}"} if valid else {}

    # -- the SERVER span

    async def serve(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one HTTP request inside its SERVER span (HTTP semantic conventions)."""
        parent = self._parent(scope["headers"])
        method = scope["method"]
        span = self.spans.start(method, parent, SpanKind.SERVER, {
            "http.request.method": method, "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
        })
        status = 0

        def send_status(message: Message) -> Awaitable[None]:
            # A plain function handing back send's awaitable: no coroutine of its own per
            # message (a stream sends one a chunk).
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

        base = scope.get("root_path", "")
        attached = otel_context.attach(trace.set_span_in_context(span, parent))
        current = CURRENT.set(span.get_span_context())
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
            CURRENT.reset(current)
            otel_context.detach(attached)
            if span.is_recording():  # sampled out: a span with nothing to say
                _describe(span, scope, base, method, status)
            span.end()

    def _parent(self, headers: Any) -> otel_context.Context:
        """The client's span (its Trace Context headers), else none: a new trace."""
        if not self.propagate:
            return _ROOT
        found = _trace_headers(headers)
        return _PROPAGATOR.extract(found) if found else _ROOT


class _SettledResource(Resource):
    """The SDK's Resource with its hash worked out once: the OTLP encoder groups every span
    it exports by resource, and Resource hashes itself by a JSON dump of its attributes
    each time (8 µs a span on the benchmark machine), though it never changes."""

    def __init__(self, attributes: Mapping[str, Any], schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    @classmethod
    def of(cls, resource: Resource) -> _SettledResource:
        """`resource`, settled."""
        return cls(resource.attributes, resource.schema_url)

    def __hash__(self) -> int:
        return self._hash


class _Current:
    """A span made memproxy's current one while a `with` block runs (and OpenTelemetry's
    too for a `root`, see the module's docstring), and ended after it: the SDK's
    `start_as_current_span` in a class instead of two generator context managers, with its
    rule for exceptions (an Exception is recorded and marks the span failed; a
    cancellation is not an error)."""

    __slots__ = ("_attached", "_root", "_span", "_token")

    def __init__(self, span: Span, *, root: bool = False) -> None:
        self._span = span
        self._root = root

    def __enter__(self) -> Span:
        span = self._span
        self._token: Token[SpanContext | None] = CURRENT.set(span.get_span_context())
        if self._root:
            self._attached = otel_context.attach(trace.set_span_in_context(span))
        return span

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        CURRENT.reset(self._token)
        if self._root:
            otel_context.detach(self._attached)
        if isinstance(exc, Exception):
            failed(self._span, exc)
        self._span.end()


def _describe(span: Span, scope: Scope, base: str, method: str, status: int) -> None:
    """What the SERVER span learned once the request ran: its route and status."""
    route = getattr(scope.get("route"), "path", None)
    found: dict[str, Any] = {}
    if isinstance(route, str):
        route = scope.get("root_path", "")[len(base):] + route  # under a Mount
        found["http.route"] = route
        span.update_name(f"{method} {route}")
    if status:
        found["http.response.status_code"] = status
        if status >= 500:
            found["error.type"] = str(status)
            span.set_status(Status(StatusCode.ERROR))
    if found:
        span.set_attributes(found)


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


def span_context(parent: str) -> trace.SpanContext | None:
    """The span a W3C traceparent names, None when it names none validly."""
    context = _PROPAGATOR.extract({"traceparent": parent})
    found = trace.get_current_span(context).get_span_context()
    return found if found.is_valid else None


def traceparent(context: trace.SpanContext) -> str:
    """The W3C `traceparent` of a span, as the SDK's propagator writes it (version 00)."""
    trace_id, span_id, _, flags, _, _ = context  # the fields, without their properties
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def _headers(context: trace.SpanContext) -> dict[str, str]:
    """The Trace Context headers that continue the span `context` ({} for no span)."""
    trace_id, span_id, _, flags, state, valid = context  # the fields, without their properties
    if not valid:
        return {}
    found = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"}
    if state is not DEFAULT_TRACE_STATE and state:  # most spans': told by identity
        found["tracestate"] = state.to_header()
    return found


def propagates_trace_context(configured: str) -> bool:
    """Whether OTEL_PROPAGATORS (unset: `tracecontext,baggage`) asks for W3C Trace Context;
    `none` anywhere turns propagation off, as in the SDK. Propagators memproxy does not
    speak (b3, jaeger, xray, ...) are named in a warning and left out."""
    names = [name.strip().lower() for name in configured.split(",") if name.strip()]
    if not names:
        return True
    if unknown := [name for name in names if name not in PROPAGATORS]:
        log.warning("OTEL_PROPAGATORS: memproxy propagates only tracecontext (and passes"
                    f" baggage through), not {', '.join(unknown)}")
    return "tracecontext" in names and "none" not in names


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

