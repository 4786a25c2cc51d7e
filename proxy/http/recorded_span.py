"""memproxy's spans: the SDK's `Span`, made and ended for a fraction of its cost (docs/tracing.md).

The SDK's `Tracer.start_span` costs 30-45 µs a span on the benchmark machine: it asks the
sampler even for a child of a sampled span, records span metrics, copies every attribute
through a validating `BoundedAttributes`, makes two `BoundedList`s, a lock and, at the end,
a second `ReadableSpan` to hand the processor. A memory-on request makes eleven spans, so
that alone was past the 0.3 ms a request that tracing may cost.

`SpanMaker` keeps the SDK's rules and does less work for them:
- the provider's sampler decides each root, and each span whose parent is remote; but a
  root is sampled without asking the SDK's own `always_on` and `parentbased_always_on` (the
  default) samplers, which sample every one (about 3 µs a request and a job);
- a child of a span of this process is sampled, or sampled out, with it, without asking the
  sampler. Every sampler the SDK builds from OTEL_TRACES_SAMPLER samples the child of a
  sampled span and drops the child of one it dropped; another sampler is asked every time;
- its parent comes as a `SpanContext` (memproxy's current span, proxy/http/tracing.py), not
  an OpenTelemetry `Context`; one is made only when a sampler is asked;
- a span's own `SpanContext` is built without the checks of its constructor when its ids
  are known valid (the parent's trace id; a span id the generator gave, checked here);
- attributes sit in a plain dict, inside the provider's span limits (count and length).
  Values of the simple types are kept as they are, in one loop; others are cleaned by the
  SDK's own rule;
- the span is its own `ReadableSpan` when it ends: nothing can change it afterwards;
- an ended span goes straight into a `BatchSpanProcessor`'s queue, when its sampled flag
  says the processor's `on_end` would put it there: `on_end` reads the flag through three
  properties (about 0.4 µs a span), and its `emit` asks for the process id (a system call)
  to tell a fork. The queue's own `emit` still takes the span that makes a batch (it wakes
  the exporter's thread) or finds the queue full. Any other processor gets `on_end`.

A span made current, ended and queued costs about 3 µs of the event loop's CPU, and an
attribute 0.25 µs, where the first SpanMaker took 6.4 µs and 0.5 µs (docs/tracing.md).

Where this departs from the SDK, and why:
- a RecordedSpan has no lock of its own. memproxy touches a span from one thread at a time
  (the event loop's; a span opened in a worker thread is that thread's alone), and the
  exporter's thread reads it only once it ended, so the lock guarded nothing. Its own
  writers check `_end_time` without one; the SDK method it inherits and uses
  (`set_status`) takes a lock that all RecordedSpans share, so it works as written. `end`
  is idempotent: the second call finds the end time set;
- SpanMaker sets a RecordedSpan's fields itself: the SDK's `Span.__new__` (a guard against
  making a Span directly) and `__init__` (the work above) never run;
- the queue is reached through `BatchSpanProcessor._batch_processor.emit`, the SDK's own
  internal attribute; if a release moves it, spans go through `on_end` again.

A `RecordedSpan` is an `opentelemetry.sdk.trace.Span`, so any processor or exporter takes
it; memproxy's own (proxy/http/otlp_export.py) reads its fields directly.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar, Token
from time import time_ns
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import _clean_attribute_value
from opentelemetry.context import Context
from opentelemetry.sdk.trace import (
    Event,
    ReadableSpan,
    Span,
    SpanLimits,
    SpanProcessor,
    TracerProvider,
)
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    DEFAULT_ON,
    ParentBased,
    Sampler,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.span import DEFAULT_TRACE_STATE
from opentelemetry.trace.status import Status, StatusCode

UNSET = Status(StatusCode.UNSET)  # a span's status until one is set
_NONE: tuple[Any, ...] = ()  # no events or links (yet)
_PLAIN = frozenset({bool, int, float})
_SAMPLED = TraceFlags.SAMPLED
_SPAN_ID_END = 1 << 64  # valid ids are in 1 .. 2**64 - 1 (spans), 2**128 - 1 (traces)
_TRACE_ID_END = 1 << 128
_new_tuple = tuple.__new__
_new_span = object.__new__
_getrandbits = random.getrandbits  # what RandomIdGenerator draws its ids with
_EMPTY = Context()  # no parent, for a sampler asked about a new trace
# memproxy's current span (proxy/http/tracing.py), None outside any: its SpanContext.
CURRENT: ContextVar[SpanContext | None] = ContextVar("memproxy_span", default=None)
# The samplers OTEL_TRACES_SAMPLER names (sampling._KNOWN_SAMPLERS): each samples the child
# of a sampled span of this process, and drops the child of one it dropped (ParentBased by
# its default delegates, the ratio by the same trace id, always_on never drops the parent,
# always_off never samples it).
_FOLLOWING = (ParentBased, StaticSampler, TraceIdRatioBased)


class SpanMaker:
    """Spans of one provider, its sampler, limits, ids, resource and processor."""

    def __init__(self, provider: TracerProvider, processor: SpanProcessor, scope: str) -> None:
        self.sampler: Sampler = provider.sampler
        self.ids = provider.id_generator
        self.limits: SpanLimits = provider._span_limits
        self.resource = provider.resource
        # As the SDK's provider.get_tracer(scope) names it: a batch's spans are one scope.
        self.scope = InstrumentationScope(scope, "", "")
        self.processor = processor
        self.follows_parent = isinstance(self.sampler, _FOLLOWING)
        self.random_ids = self.ids.is_trace_id_random()
        # The SDK's default generator's span ids, drawn here without its method's frame.
        self.draws_span_ids = type(self.ids) is RandomIdGenerator
        # The SDK's own instances (what OTEL_TRACES_SAMPLER names), whose decision for a root
        # is always RECORD_AND_SAMPLE with the span's attributes and no trace state.
        self.samples_roots = self.sampler is ALWAYS_ON or self.sampler is DEFAULT_ON
        self.root_flags = TraceFlags(TraceFlags.SAMPLED | (TraceFlags.RANDOM_TRACE_ID if self.random_ids else 0))
        self.ended = _ender(processor)

    def child(self, name: str, parent: SpanContext, attributes: Mapping[str, Any] | None) -> trace.Span:
        """A span under `parent`, a sampled span (the caller checked): sampled with it when
        it is of this process, else as `start` decides."""
        trace_id, _, remote, flags, state, _ = parent  # the fields, without their properties
        if self.follows_parent and not remote:
            return self._recorded(name, parent, trace_id, flags, state, SpanKind.INTERNAL, attributes,
                                  _NONE, None)
        return self.begin(name, parent, SpanKind.INTERNAL, attributes)

    def start(
        self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None, links: Sequence[Link] = (),
        start_ns: int | None = None,
    ) -> trace.Span:
        """A span under the span of the OpenTelemetry `context` (its current one when None),
        as `begin` makes it."""
        if context is not None and not context:  # an empty context: a new trace, no lookups
            return self.begin(name, None, kind, attributes, links, start_ns, context=context)
        found = trace.get_current_span(context).get_span_context()
        return self.begin(name, found if found.is_valid else None, kind, attributes, links, start_ns,
                          context=context)

    def drops_child_of(self, parent: SpanContext | None) -> bool:
        """Whether `begin` samples a child of `parent` out without asking the sampler: the
        parent is a span of this process that was sampled out (see the module's docstring)."""
        return parent is not None and self.follows_parent and not parent[2] and not parent[3] & _SAMPLED

    def begin(
        self, name: str, parent: SpanContext | None, kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None, links: Sequence[Link] = (),
        start_ns: int | None = None, *, context: Context | None = None,
    ) -> trace.Span:
        """A span under `parent` (a valid span, or None for a new trace): recording when
        sampled, else the SDK's non-recording span carrying the decision on. `context` is
        what a sampler asked is given (made of `parent` when None, empty for a new trace)."""
        if parent is not None and self.follows_parent and not parent[2]:  # not remote
            trace_id, _, _, flags, state, _ = parent  # the fields, without their properties
            if flags & _SAMPLED:
                return self._recorded(name, parent, trace_id, flags, state, kind, attributes,
                                      links, start_ns)
            # Sampled out with its parent, as each of those samplers decides it (see above):
            # the SDK's non-recording span, with the parent's flags and trace state.
            return trace.NonRecordingSpan(self._own_context(trace_id, flags, state))
        if parent is None and self.samples_roots:
            return self._recorded(name, None, self.ids.generate_trace_id(), self.root_flags,
                                  DEFAULT_TRACE_STATE, kind, attributes, links, start_ns)
        if context is None:
            context = _EMPTY if parent is None else trace.set_span_in_context(trace.NonRecordingSpan(parent))
        trace_id = parent.trace_id if parent is not None else self.ids.generate_trace_id()
        decided = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        sampled = decided.decision.is_sampled()  # type: ignore[no-untyped-call]
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        random_id = parent.trace_flags.random_trace_id if parent is not None else self.random_ids
        if random_id:
            flags = TraceFlags(flags | TraceFlags.RANDOM_TRACE_ID)
        if decided.decision.is_recording():  # type: ignore[no-untyped-call]
            return self._recorded(name, parent, trace_id, flags, decided.trace_state, kind,
                                  decided.attributes, links, start_ns)
        own = SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False,
                          trace_flags=flags, trace_state=decided.trace_state)
        return trace.NonRecordingSpan(own)

    def _recorded(
        self, name: str, parent: SpanContext | None, trace_id: int, flags: TraceFlags,
        state: TraceState | None, kind: SpanKind, attributes: Mapping[str, Any] | None,
        links: Sequence[Link], start_ns: int | None,
    ) -> RecordedSpan:
        """A recording span of a new span id in the trace `trace_id`."""
        span: RecordedSpan = _new_span(RecordedSpan)
        span._name = name
        span._context = self._own_context(trace_id, flags, state)
        span._parent = parent
        span._kind = kind
        span._start_time = start_ns if start_ns is not None else time_ns()
        span._resource = self.resource
        span._instrumentation_scope = self.scope
        span._limits = self.limits
        span._maker = self
        span._attributes = {}
        if attributes:
            span._set_all(attributes)
        if links:
            span._links = span._new_links(links)
        return span

    def _own_context(self, trace_id: int, flags: TraceFlags, state: TraceState | None) -> SpanContext:
        """The SpanContext of a new span of this process in the trace `trace_id`, with the
        fields its constructor checks and defaults: only a trace id from a valid parent or
        the id generator comes here, and the span id is checked as the constructor would."""
        # RandomIdGenerator draws again for a 0, as it does.
        span_id = (self.draws_span_ids and _getrandbits(64)) or self.ids.generate_span_id()
        if state is None or not 0 < trace_id < _TRACE_ID_END or not 0 < span_id < _SPAN_ID_END:
            return SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=state)
        return _new_tuple(SpanContext, (trace_id, span_id, False, flags, state, True))


class RecordedSpan(Span):
    """A recording span (see the module's docstring), made only by `SpanMaker`, which sets
    its fields itself: neither the SDK's `Span.__new__` (a guard against making a Span
    directly) nor its `__init__` runs. Read by the exporter only once ended."""

    _attributes: dict[str, Any]  # set by SpanMaker
    _context: SpanContext
    _maker: SpanMaker
    _instrumentation_info = None
    _status = UNSET
    _end_time: int | None = None
    _events: Sequence[Event] = _NONE  # a BoundedList from the first one on
    _links: Sequence[Link] = _NONE
    _dropped = 0  # attributes
    _record_exception = True
    _set_status_on_exception = True
    _record_end_metrics = None
    _token: Token[SpanContext | None]  # while current (__enter__)
    # For the SDK methods inherited (set_status): one lock for all (see above).
    _lock = threading.Lock()

    @property
    def dropped_attributes(self) -> int:
        return self._dropped

    def get_span_context(self) -> SpanContext:
        return self._context  # the SDK's wraps it in a typing.cast, a call a span

    # -- memproxy's current span while a `with` block runs (Tracing.span), ended after it

    def __enter__(self) -> RecordedSpan:
        self._token = CURRENT.set(self._context)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """The SDK span's `__exit__` (an exception is recorded and marks the span failed),
        except that a cancellation is not an error; and the span stops being current."""
        CURRENT.reset(self._token)
        if isinstance(exc, Exception):
            failed(self, exc)
        if self._end_time is None:  # `end`, inline: a call fewer for every step
            self._end_time = time_ns()
            self._maker.ended(self)

    @property
    def _span_processor(self) -> SpanProcessor:  # type: ignore[override]
        """The SDK's Span's processor (which RecordedSpan's `end` leaves to its maker)."""
        return self._maker.processor

    # -- writing

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end_time is None:
            self._set(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._end_time is None:
            self._set_all(attributes)

    def _set_all(self, attributes: Mapping[str, Any]) -> None:
        """`_set` of each, with what it checks for the common case done inline: room for
        them all, a new text key, and a flag, a number, or a text within the length limit."""
        held = self._attributes
        limits = self._limits
        most = limits.max_span_attributes
        if most is not None and len(held) + len(attributes) > most:
            for key, value in attributes.items():
                self._set(key, value)
            return
        length = limits.max_span_attribute_length
        for key, value in attributes.items():
            kind = type(value)
            if (kind in _PLAIN or (kind is str and (length is None or len(value) <= length))) \
                    and type(key) is str and key and key not in held:
                held[key] = value
            else:
                self._set(key, value)

    def _set(self, key: str, value: Any) -> None:
        """One attribute, inside the span limits: the SDK's rules (an invalid key is left
        out, the oldest attribute makes room, long strings are cut)."""
        if not key or type(key) is not str:
            self._dropped += 1
            return
        kind = type(value)
        if kind is str:
            limit = self._limits.max_span_attribute_length
            if limit is not None and len(value) > limit:
                value = value[:limit]
        elif kind not in _PLAIN:
            value = _clean_attribute_value(value, self._limits.max_span_attribute_length)
        held = self._attributes
        if key in held:
            del held[key]
        elif (most := self._limits.max_span_attributes) is not None and len(held) >= most:
            if not most:
                self._dropped += 1
                return
            del held[next(iter(held))]
            self._dropped += 1
        held[key] = value

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def _add_event(self, event: Event) -> None:
        # Span.add_event made the event and its attributes, within the limits.
        if self._end_time is None:
            if not isinstance(self._events, BoundedList):
                self._events = BoundedList(self._limits.max_events)
            self._events.append(event)

    def _add_link(self, link: Link) -> None:
        if self._end_time is None:
            if not isinstance(self._links, BoundedList):
                self._links = BoundedList(self._limits.max_links)
            self._links.append(link)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time if end_time is not None else time_ns()
        self._maker.ended(self)


def failed(span: trace.Span, exc: Exception) -> None:
    """What a `with` block's exception leaves on its span, as the SDK span's `__exit__`
    leaves it: the exception, and an error status naming it."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def _ender(processor: SpanProcessor) -> Callable[[ReadableSpan], None]:
    """What takes an ended span: `processor.on_end`, or for the SDK's BatchSpanProcessor its
    queue (what its `on_end` does, without the properties)."""
    batch: Any = getattr(processor, "_batch_processor", None)
    emit = getattr(batch, "emit", None)
    queue = getattr(batch, "_queue", None)
    if type(processor) is not BatchSpanProcessor or not callable(emit):
        return processor.on_end
    if type(queue) is not deque or queue.maxlen is None \
            or type(getattr(batch, "_max_export_batch_size", None)) is not int:
        def emitted(span: ReadableSpan) -> None:
            if span._context[3] & _SAMPLED:  # type: ignore[index]  # its trace_flags
                emit(span)

        return emitted
    # Below this length, `emit` would only put the span in the queue: it wakes the worker
    # when the queue reaches a batch, and drops a span (with a warning) when it is full.
    # Its other check, for a fork, is the SDK's own fork hook's (os.register_at_fork).
    short = min(batch._max_export_batch_size, queue.maxlen) - 1

    def ended(span: ReadableSpan) -> None:
        if span._context[3] & _SAMPLED:  # type: ignore[index]  # its trace_flags
            if len(queue) < short and not batch._shutdown:
                queue.appendleft(span)
            else:
                emit(span)

    return ended
