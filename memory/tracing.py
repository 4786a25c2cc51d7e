"""Spans around memory's steps, through the OpenTelemetry API only (docs/tracing.md).

memory is an instrumented library: it asks the API for a tracer and never configures one.
With no SDK configured (proxy/http/telemetry.py) the tracer is a no-op. A step under a span
that was sampled out (or under none) opens no span at all: its children would be sampled
out too, and skipping them keeps a request that is not traced cheap.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

from opentelemetry import context, trace
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

__all__ = ["QUEUED_BY", "Span", "db_span", "linked", "span", "traced", "traceparent"]

Attributes = Mapping[str, AttributeValue]
# The job payload's key for the W3C traceparent of the span that queued it (a span link).
QUEUED_BY = "traceparent"
_P = ParamSpec("_P")
_R = TypeVar("_R")
_OFF: AbstractContextManager[None] = contextlib.nullcontext()
_W3C = TraceContextTextMapPropagator()  # the job link's format, whatever OTEL_PROPAGATORS says
_tracer = trace.get_tracer(__name__)


def sampled() -> bool:
    """Whether the current span is sampled (False outside any span)."""
    return trace.get_current_span().get_span_context().trace_flags.sampled


def span(name: str, attributes: Attributes | None = None) -> AbstractContextManager[Span | None]:
    """A span named `name` under the current one, current while open; None under a span
    sampled out or none (so attributes are computed only for a span: `if s is not None:`)."""
    if not sampled():
        return _OFF
    return _tracer.start_as_current_span(name, attributes=attributes)


def traced(
    name: str,
) -> Callable[[Callable[_P, Coroutine[Any, Any, _R]]], Callable[_P, Coroutine[Any, Any, _R]]]:
    """Run an async function inside a span named `name` (see `span`)."""

    def wrap(function: Callable[_P, Coroutine[Any, Any, _R]]) -> Callable[_P, Coroutine[Any, Any, _R]]:
        @functools.wraps(function)
        async def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with span(name):
                return await function(*args, **kwargs)

        return run

    return wrap


def linked(
    name: str, links: Sequence[str], attributes: Attributes | None = None
) -> AbstractContextManager[Span]:
    """A CONSUMER span that starts a trace of its own, linked to each W3C traceparent in
    `links`: a background job and the requests that queued it."""
    found = [Link(parent) for link in links if (parent := span_context(link)) is not None]
    return _tracer.start_as_current_span(name, context.Context(), SpanKind.CONSUMER,
                                         attributes=attributes, links=found)


def db_span(dialect: str, operation: str, table: str) -> AbstractContextManager[Span | None]:
    """A database step of our own (the DB semantic conventions' names), on either backend."""
    if not sampled():
        return _OFF
    name, attributes = _db_step(dialect, operation, table)
    return _tracer.start_as_current_span(name, attributes=attributes)


@functools.lru_cache(maxsize=64)
def _db_step(dialect: str, operation: str, table: str) -> tuple[str, Attributes]:
    """A database step's span name and attributes: a few steps, made once each."""
    return f"{operation} {table}", {
        "db.system.name": "postgresql" if dialect == "postgres" else dialect,
        "db.operation.name": operation, "db.collection.name": table,
    }


def traceparent() -> str | None:
    """The current span's W3C traceparent, for a job queued now to link back to (None
    when it is sampled out: there is nothing to link to)."""
    if not sampled():
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent")


def span_context(parent: str) -> trace.SpanContext | None:
    """The span a W3C traceparent names, None when it names none validly."""
    found = trace.get_current_span(_W3C.extract({"traceparent": parent})).get_span_context()
    return found if found.is_valid else None
