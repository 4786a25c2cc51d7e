"""The OTLP/HTTP span exporter, with the protobuf written directly (docs/tracing.md).

The official exporter builds a protobuf object for every span, attribute and value, and
upb copies each into its parent: about 40 µs a span on the benchmark machine, more than the
SDK's span itself costs to make. Here the bytes of each span are written in one pass, and
the fields memproxy's spans repeat (names, attribute keys, short attribute values) are
encoded once; a RecordedSpan's fields are read as they are, not through the ReadableSpan
properties that copy them: about 4 µs a span of a memory-on request (7 µs before these
last two). Everything else is the official exporter's: its endpoint, headers, compression,
certificates, timeout and retries from the OTEL_EXPORTER_OTLP_* variables, its size limit
and its own metrics. The official encoder still encodes the resource and the
instrumentation scope, once a batch.

Its `requests` session reads the environment on every export: the proxy variables (all of
os.environ, twice), NO_PROXY, the CA bundle variables and ~/.netrc; a 512-span batch took
1.47 ms of the export thread's CPU to send that way and 1.15 ms without (a microbenchmark,
36 variables set). The exporter sends to one URL, so what they say is read once, when it
is made, as requests would read it then.

What is written is the message the official encoder makes of the same spans, byte for byte
for each span (tests/test_tracing_export.py): the same fields, the same presence of empty
and default values, an attribute it cannot encode left out the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import requests
from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
from opentelemetry.exporter.otlp.proto.common._internal import (
    _encode_instrumentation_scope,
    _encode_resource,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import DEFAULT_TRACE_STATE
from opentelemetry.trace.status import StatusCode

from proxy.http.logs import get_logger
from proxy.http.recorded_span import UNSET, RecordedSpan

log = get_logger("tracing.export")

# Span.kind, field 6: the protobuf enum's numbers (INTERNAL is 1 there, 0 in the API), by
# the API's number (`_value_`: an Enum member hashes itself in Python, `value` is a property).
_KINDS = {kind._value_: b"\x30" + bytes([kind._value_ + 1]) for kind in SpanKind}
_INT64 = (-(1 << 63), (1 << 63) - 1)
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_double = struct.Struct("<d").pack
# SpanFlags (Span field 16, Link field 6; fixed32): whether the parent, or the linked span,
# is remote is known (0x100), and is it (0x200).
_SPAN_FLAGS = {False: b"\x85\x01" + _fixed32(0x100), True: b"\x85\x01" + _fixed32(0x300)}
_LINK_FLAGS = {False: b"\x35" + _fixed32(0x100), True: b"\x35" + _fixed32(0x300)}
# Fields memproxy's spans repeat, encoded once (until there are more than _KEPT): names,
# and KeyValue pairs of a flag, a number or a short text.
_names: dict[str, bytes] = {}
_pairs: dict[tuple[bytes, str, type, Any], bytes] = {}
_keys: dict[str, bytes] = {}  # KeyValue.key, field 1, of a pair whose value varies
_KEPT = 4096
_ATOMS = frozenset({str, bool, int})
_COMMON_TEXT = 64
# Fixed parts: trace and span ids (fields 1 and 2), the parent's id (4), times (7 and 8).
_IDS = struct.Struct(">BBQQBBQ").pack
_PARENT = struct.Struct(">BBQ").pack
_TIMES = struct.Struct("<BQBQ").pack
_TIME = struct.Struct("<BQ").pack
_LOW64 = (1 << 64) - 1
_NO_STATE = DEFAULT_TRACE_STATE  # most spans': told by identity, without TraceState.__len__


class FastOTLPSpanExporter(OTLPSpanExporter):
    """OTLPSpanExporter, writing the request's protobuf itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        transport = getattr(self._client, "_transport", None)
        if isinstance(transport, RequestsHTTPTransport):
            settle_environment(transport._session, self._endpoint)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """The official `export`, with `encode_request` for its encoder."""
        if self._shutdown:
            return super().export(spans)  # which refuses, and says so
        with self._metrics.export_operation(len(spans)) as result:
            try:
                data = encode_request(spans)
            except Exception as error:
                log.error("Failed to encode span batch: %s", error)
                result.error = error
                return SpanExportResult.FAILURE
            if 0 < self._max_request_size < len(data):
                log.warning("Dropping span batch: serialized size %d bytes exceeds"
                            " max_request_size %d bytes.", len(data), self._max_request_size)
                return SpanExportResult.FAILURE
            sent = self._client.export(data)
            if not sent.success:
                result.error = sent.error
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS


def settle_environment(session: requests.Session, url: str) -> None:
    """Have `session` send to `url` with what the environment says now (proxies, NO_PROXY,
    the CA bundle, ~/.netrc credentials), as requests reads it on each request when the
    session trusts the environment; then stop reading it. A session that does not trust
    it is left as it is."""
    if not session.trust_env:
        return
    found = session.merge_environment_settings(url, {}, None, session.verify, session.cert)
    session.proxies = found["proxies"]
    session.verify = found["verify"]
    if session.auth is None:  # requests asks ~/.netrc only when no credentials are set
        session.auth = requests.utils.get_netrc_auth(url)
    session.trust_env = False


def encode_request(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest of `spans`, grouped by resource and scope."""
    grouped: dict[tuple[Resource, InstrumentationScope | None], list[bytes]] = {}
    last: tuple[Any, Any] = (None, None)
    encoded: list[bytes] = []
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        if resource is not last[0] or scope is not last[1]:  # a batch has one, almost always
            last = (resource, scope)
            encoded = grouped.setdefault(last, [])
        encoded.append(encode_span(span))
    by_resource: dict[Resource, bytearray] = {}
    for (resource, scope), group in grouped.items():
        # A message's fields may come in any order, and repeated ones may be appended: the
        # ResourceSpans and ScopeSpans without their spans, then the spans, is the message.
        scope_spans = bytearray(ScopeSpans(
            scope=_encode_instrumentation_scope(scope),  # type: ignore[arg-type]
            schema_url=scope.schema_url if scope else None,  # type: ignore[arg-type]
        ).SerializeToString())
        for span_bytes in group:
            _field(scope_spans, b"\x12", span_bytes)
        if resource not in by_resource:
            by_resource[resource] = bytearray(ResourceSpans(
                resource=_encode_resource(resource), schema_url=resource.schema_url,
            ).SerializeToString())
        _field(by_resource[resource], b"\x12", scope_spans)
    request = bytearray()
    for resource_spans in by_resource.values():
        _field(request, b"\x0a", resource_spans)
    return bytes(request)


def encode_span(span: ReadableSpan) -> bytes:
    """One `Span` message (opentelemetry/proto/trace/v1/trace.proto), fields in order. A
    RecordedSpan's fields are read as they are: the ReadableSpan properties wrap its
    attributes in a MappingProxyType, copy its events and links into tuples and tell its
    dropped counts by isinstance, about a fifth of the cost of encoding it."""
    attributes: Mapping[str, Any] | None
    events: Sequence[Event]
    links: Sequence[Link]
    if type(span) is RecordedSpan:
        context, parent, name, kind = span._context, span._parent, span._name, span._kind
        start, end, attributes, dropped = span._start_time, span._end_time, span._attributes, span._dropped
        events, links, status = span._events, span._links, span._status
        dropped_events = events.dropped if type(events) is BoundedList else 0
        dropped_links = links.dropped if type(links) is BoundedList else 0
    else:
        context, parent, name, kind = span.context, span.parent, span.name, span.kind
        start, end, attributes, dropped = span.start_time, span.end_time, span.attributes, span.dropped_attributes
        events, links, status = span.events, span.links, span.status
        dropped_events, dropped_links = span.dropped_events, span.dropped_links
    trace_id, span_id, _, _, state, _ = context
    out = bytearray(_IDS(0x0A, 16, trace_id >> 64, trace_id & _LOW64, 0x12, 8, span_id))
    if state is not _NO_STATE and state:
        _string(out, b"\x1a", ",".join(f"{key}={value}" for key, value in state.items()))
    remote = False
    if parent:
        _, parent_id, remote, _, _, _ = parent
        out += _PARENT(0x22, 8, parent_id)
    if name:
        if (field := _names.get(name)) is None:
            written = bytearray()
            _string(written, b"\x2a", name)
            if len(_names) >= _KEPT:
                _names.clear()
            field = _names[name] = bytes(written)
        out += field
    out += _KINDS[kind._value_]
    if start and end:
        out += _TIMES(0x39, start, 0x41, end)
    else:
        if start:
            out += _TIME(0x39, start)
        if end:
            out += _TIME(0x41, end)
    if attributes:
        _attributes(out, b"\x4a", attributes)
    if dropped:
        _count(out, b"\x50", dropped)
    for event in events:
        encoded = bytearray(_TIME(0x09, event.timestamp))
        if event.name:
            _string(encoded, b"\x12", event.name)
        _attributes(encoded, b"\x1a", event.attributes)
        _count(encoded, b"\x20", event.dropped_attributes)
        _field(out, b"\x5a", encoded)
    if dropped_events:
        _count(out, b"\x60", dropped_events)
    for link in links:
        linked = link.context
        encoded = bytearray(_IDS(0x0A, 16, linked.trace_id >> 64, linked.trace_id & _LOW64, 0x12, 8,
                                 linked.span_id))
        _attributes(encoded, b"\x22", link.attributes)
        _count(encoded, b"\x28", link.dropped_attributes)
        encoded += _LINK_FLAGS[linked.is_remote]
        _field(out, b"\x6a", encoded)
    if dropped_links:
        _count(out, b"\x70", dropped_links)
    if status is UNSET:  # a RecordedSpan's until one is set
        out += b"\x7a\x00"
    elif status is not None:  # present, even empty (an unset status)
        code = status.status_code
        if code is StatusCode.UNSET and not status.description:
            out += b"\x7a\x00"
        else:
            encoded = bytearray()
            if status.description:
                _string(encoded, b"\x12", status.description)
            if code is not StatusCode.UNSET:
                encoded += b"\x18"
                encoded.append(code.value)
            _field(out, b"\x7a", encoded)
    out += _SPAN_FLAGS[remote]
    return bytes(out)


def _attributes(out: bytearray, tag: bytes, attributes: Mapping[str, Any] | None) -> None:
    """Repeated KeyValue under `tag`; a value the official encoder fails on is left out.
    Pairs of a short text or a flag recur from span to span, and are encoded once."""
    if not attributes:
        return
    for key, value in attributes.items():
        kind = type(value)
        common = kind in _ATOMS and (kind is not str or len(value) <= _COMMON_TEXT)
        if common and (pair := _pairs.get((tag, key, kind, value))) is not None:
            out += pair
            continue
        encoded = _value(value)
        if encoded is None:
            log.error("Failed to encode key %s: %r", key, kind)
            continue
        if (key_field := _keys.get(key)) is None:
            written = bytearray()
            try:
                _string(written, b"\x0a", key)
            except UnicodeEncodeError:
                log.error("Failed to encode key %r", key)
                continue
            if len(_keys) >= _KEPT:
                _keys.clear()
            key_field = _keys[key] = bytes(written)
        written = bytearray(key_field)
        _field(written, b"\x12", encoded)
        whole = bytearray(tag)
        _field(whole, b"", written)
        if common:
            if len(_pairs) >= _KEPT:
                _pairs.clear()
            _pairs[(tag, key, kind, value)] = bytes(whole)
        out += whole


def _value(value: Any) -> bytearray | None:
    """An AnyValue: its one field, present even when it holds the default (a oneof); None
    for what the official encoder fails on (a type it does not know, an int beyond int64,
    text that is not Unicode)."""
    out = bytearray()
    kind = type(value)
    if kind is str:
        try:
            _string(out, b"\x0a", value)
        except UnicodeEncodeError:
            return None
    elif kind is bool:
        out += b"\x10\x01" if value else b"\x10\x00"
    elif kind is int:
        if not _INT64[0] <= value <= _INT64[1]:
            return None
        out += b"\x18"
        _varint(out, value & 0xFFFFFFFFFFFFFFFF)
    elif kind is float:
        out += b"\x21"
        out += _double(value)
    elif value is None:
        pass
    else:
        return _other_value(value)
    return out


def _other_value(value: Any) -> bytearray | None:
    """The AnyValue of a subclass, bytes, a sequence or a mapping, told apart in the
    official encoder's order (isinstance; bool before str before int)."""
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return _value(kind(value) if kind is not str else str.__str__(value))
    out = bytearray()
    if isinstance(value, bytes):
        _field(out, b"\x3a", value)
    elif isinstance(value, Sequence):
        array = bytearray()
        for item in value:
            if (encoded := _value(item)) is None:
                return None
            _field(array, b"\x0a", encoded)
        _field(out, b"\x2a", array)
    elif isinstance(value, Mapping):
        pairs = bytearray()
        for key, item in value.items():
            if (encoded := _value(item)) is None:
                return None  # one bad value fails the whole list, as upstream
            pair = bytearray()
            _string(pair, b"\x0a", str(key))
            _field(pair, b"\x12", encoded)
            _field(pairs, b"\x0a", pair)
        _field(out, b"\x32", pairs)
    else:
        return None
    return out


def _field(out: bytearray, tag: bytes, payload: bytes | bytearray) -> None:
    """A length-delimited field: its tag, its length, its bytes."""
    out += tag
    if (size := len(payload)) < 0x80:  # one byte's varint, as most are
        out.append(size)
    else:
        _varint(out, size)
    out += payload


def _string(out: bytearray, tag: bytes, text: str) -> None:
    """A string field, present even when empty (callers leave out what proto3 omits)."""
    _field(out, tag, text.encode())


def _count(out: bytearray, tag: bytes, count: int) -> None:
    """A uint32 count, left out when 0 (proto3)."""
    if count:
        out += tag
        _varint(out, count)


def _varint(out: bytearray, number: int) -> None:
    """A base-128 varint of a non-negative number."""
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)
