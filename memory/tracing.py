"""Spans around memory's steps, for whoever traces (docs/tracing.md); free when nobody does.

memory never imports an HTTP framework nor a tracing SDK: the proxy, when tracing is on,
activates its `Tracer` for a request (and for the lifespan, so the job worker inherits it),
and memory's steps open spans through it. The tracer travels in a context variable, the way
OpenTelemetry carries the current span itself, so every task a request starts inherits it
and two apps in one process (the tests) never see each other's. Off, `span()` is one
context-variable read returning a shared no-op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any, ParamSpec, Protocol, TypeVar

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]
Attributes = Mapping[str, AttributeValue]
# The job payload's key for the W3C traceparent of the span that queued it (a span link).
QUEUED_BY = "traceparent"


class Span(Protocol):
    """The part of a span memory writes to."""

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        """Record one attribute."""
        ...

    def set_attributes(self, attributes: Attributes) -> None:
        """Record several."""
        ...


class Tracer(Protocol):
    """What the proxy's tracing gives memory (proxy/http/tracing.py)."""

    def span(
        self, name: str, attributes: Attributes | None = None
    ) -> AbstractContextManager[Span | None]:
        """A child of the current span, current while open (None: not recorded)."""
        ...

    def linked(
        self, name: str, links: Sequence[str], attributes: Attributes | None = None
    ) -> AbstractContextManager[Span]:
        """A new trace's root span, linked to each W3C `traceparent` in `links`."""
        ...

    def traceparent(self) -> str | None:
        """The current span's W3C traceparent (None when none is recording)."""
        ...


_P = ParamSpec("_P")
_R = TypeVar("_R")
_ACTIVE: ContextVar[Tracer | None] = ContextVar("memproxy_tracer", default=None)
_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def span(name: str, attributes: Attributes | None = None) -> AbstractContextManager[Span | None]:
    """A span named `name` under the current one while tracing is on; else a no-op that
    yields None (so attributes are computed only for a span: `if s is not None:`)."""
    tracer = _ACTIVE.get()
    return _OFF if tracer is None else tracer.span(name, attributes)


def traced(
    name: str,
) -> Callable[[Callable[_P, Coroutine[Any, Any, _R]]], Callable[_P, Coroutine[Any, Any, _R]]]:
    """Run an async function inside a span named `name` while tracing is on."""

    def wrap(function: Callable[_P, Coroutine[Any, Any, _R]]) -> Callable[_P, Coroutine[Any, Any, _R]]:
        @functools.wraps(function)
        async def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            tracer = _ACTIVE.get()
            if tracer is None:
                return await function(*args, **kwargs)
            with tracer.span(name):
                return await function(*args, **kwargs)

        return run

    return wrap


def linked(
    name: str, links: Sequence[str], attributes: Attributes | None = None
) -> AbstractContextManager[Span | None]:
    """A root span linked to the spans that asked for this work (a job's queuing requests)."""
    tracer = _ACTIVE.get()
    return _OFF if tracer is None else tracer.linked(name, links, attributes)


def db_span(dialect: str, operation: str, table: str) -> AbstractContextManager[Span | None]:
    """A database step of our own (the DB semantic conventions' names), on either backend."""
    tracer = _ACTIVE.get()
    if tracer is None:
        return _OFF
    return tracer.span(*_db_step(dialect, operation, table))


@functools.lru_cache(maxsize=64)
def _db_step(dialect: str, operation: str, table: str) -> tuple[str, Attributes]:
    """A database step's span name and attributes: a few steps, made once each."""
    return f"{operation} {table}", {
        "db.system.name": "postgresql" if dialect == "postgres" else dialect,
        "db.operation.name": operation, "db.collection.name": table,
    }


def traceparent() -> str | None:
    """The current span's traceparent, for a job queued now to link back to."""
    tracer = _ACTIVE.get()
    return None if tracer is None else tracer.traceparent()


def active() -> bool:
    """Whether this context traces (for work that is only worth doing then)."""
    return _ACTIVE.get() is not None


def activate(tracer: Tracer) -> Token[Tracer | None]:
    """Trace memory's steps in this context (and the tasks it starts) through `tracer`."""
    return _ACTIVE.set(tracer)


def deactivate(token: Token[Tracer | None]) -> None:
    """Undo `activate`."""
    _ACTIVE.reset(token)

