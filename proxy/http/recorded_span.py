"""memproxy's spans: the SDK's `Span`, made and ended for a fifth of its cost (docs/tracing.md).

The SDK's `Tracer.start_span` costs 30-45 µs a span on the benchmark machine: it asks the
sampler even for a child of a sampled span, records span metrics, copies every attribute
through a validating `BoundedAttributes`, makes two `BoundedList`s and, at the end, a
second `ReadableSpan` to hand the processor. A memory-on request makes eleven spans, so that
alone was past the 0.3 ms a request that tracing may cost.

`SpanMaker.start` keeps the SDK's rules and does less work for them:
- the provider's sampler decides each root, and each span whose parent is remote;
- a child of a sampled span of this process is sampled without asking it. Every sampler the
  SDK builds from OTEL_TRACES_SAMPLER samples those, and another sampler is asked every time;
- attributes sit in a plain dict, inside the provider's span limits (count and length).
  Values of the simple types are kept as they are; others are cleaned by the SDK's own rule;
- the span is its own `ReadableSpan` when it ends: nothing can change it afterwards.

A `RecordedSpan` is an `opentelemetry.sdk.trace.Span`, so any processor or exporter takes it;
memproxy's own (proxy/http/otlp_export.py) only reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from time import time_ns
from typing import Any

from opentelemetry import trace
from opentelemetry.attributes import _clean_attribute_value
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, StaticSampler, TraceIdRatioBased
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

_UNSET = Status(StatusCode.UNSET)
_NONE: tuple[Any, ...] = ()  # no events or links (yet)
_PLAIN = frozenset({bool, int, float})
# The samplers OTEL_TRACES_SAMPLER names (sampling._KNOWN_SAMPLERS): each samples the child
# of a sampled span of this process (ParentBased by its default delegate, the ratio by the
# same trace id, always_on always, always_off never makes the parent).
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

    def child(self, name: str, parent: SpanContext, attributes: Mapping[str, Any] | None) -> trace.Span:
        """A span under `parent`, a sampled span (the caller checked): sampled with it when
        it is of this process, else as `start` decides."""
        if self.follows_parent and not parent.is_remote:
            own = SpanContext(parent.trace_id, self.ids.generate_span_id(), is_remote=False,
                              trace_flags=parent.trace_flags, trace_state=parent.trace_state)
            return RecordedSpan(self, name, own, parent, SpanKind.INTERNAL, attributes, (), None)
        return self.start(name, attributes=attributes)

    def start(
        self, name: str, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None, links: Sequence[Link] = (),
        start_ns: int | None = None,
    ) -> trace.Span:
        """A span under the span of `context` (the current one when None): recording when
        sampled, else the SDK's non-recording span carrying the decision on."""
        found = trace.get_current_span(context).get_span_context()
        parent = found if found.is_valid else None
        if parent is not None and self.follows_parent and parent.trace_flags.sampled \
                and not parent.is_remote:
            trace_id, flags = parent.trace_id, parent.trace_flags
            state: TraceState | None = parent.trace_state
            recording = True
        else:
            trace_id = parent.trace_id if parent is not None else self.ids.generate_trace_id()
            decided = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled = decided.decision.is_sampled()  # type: ignore[no-untyped-call]
            flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
            random_id = parent.trace_flags.random_trace_id if parent is not None else self.random_ids
            if random_id:
                flags = TraceFlags(flags | TraceFlags.RANDOM_TRACE_ID)
            state, attributes = decided.trace_state, decided.attributes
            recording = decided.decision.is_recording()  # type: ignore[no-untyped-call]
        own = SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False,
                          trace_flags=flags, trace_state=state)
        if not recording:
            return trace.NonRecordingSpan(own)
        return RecordedSpan(self, name, own, parent, kind, attributes, links, start_ns)


class RecordedSpan(Span):
    """A recording span (see the module's docstring). Read by the exporter only once ended."""

    _instrumentation_info = None
    _status = _UNSET
    _end_time: int | None = None
    _events: Sequence[Event] = _NONE  # a BoundedList from the first one on
    _links: Sequence[Link] = _NONE
    _dropped = 0  # attributes
    _record_exception = True
    _set_status_on_exception = True
    _record_end_metrics = None

    def __init__(
        self, maker: SpanMaker, name: str, context: SpanContext, parent: SpanContext | None,
        kind: SpanKind, attributes: Mapping[str, Any] | None, links: Sequence[Link], start_ns: int | None,
    ) -> None:
        # What ReadableSpan's properties read, set here instead of through its __init__,
        # and what the SDK's Span methods left to it use (the class holds the defaults).
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._resource = maker.resource
        self._instrumentation_scope = maker.scope
        self._start_time = start_ns if start_ns is not None else time_ns()
        self._lock = threading.Lock()
        self._limits = maker.limits
        self._span_processor = maker.processor
        self._attributes: dict[str, Any] = {}
        if attributes:
            self._set_all(attributes)
        if links:
            self._links = self._new_links(links)

    @property
    def dropped_attributes(self) -> int:
        return self._dropped

    # -- writing

    def set_attribute(self, key: str, value: Any) -> None:
        with self._lock:
            if self._end_time is None:
                self._set(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        with self._lock:
            if self._end_time is None:
                self._set_all(attributes)

    def _set_all(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
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

    def _add_event(self, event: Event) -> None:
        # Span.add_event made the event and its attributes, within the limits.
        with self._lock:
            if self._end_time is None:
                if not isinstance(self._events, BoundedList):
                    self._events = BoundedList(self._limits.max_events)
                self._events.append(event)

    def _add_link(self, link: Link) -> None:
        with self._lock:
            if self._end_time is None:
                if not isinstance(self._links, BoundedList):
                    self._links = BoundedList(self._limits.max_links)
                self._links.append(link)

    def end(self, end_time: int | None = None) -> None:
        with self._lock:
            if self._end_time is not None:
                return
            self._end_time = end_time if end_time is not None else time_ns()
        self._span_processor.on_end(self)

