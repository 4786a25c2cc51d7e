"""memproxy's own spans and OTLP encoding (proxy/http/recorded_span.py, otlp_export.py)
against the SDK's: the same operations on an SDK span and on a RecordedSpan, the same
sampling decisions, and the same protobuf from memproxy's encoder as from the official one;
and memproxy's current span (proxy/http/tracing.py) as tasks and jobs see it."""

from __future__ import annotations

import asyncio
import base64
import gzip
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import _encode_span
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import (
    INVALID_SPAN,
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace.status import Status, StatusCode

from proxy.http.otlp_export import FastOTLPSpanExporter, encode_request, encode_span
from proxy.http.recorded_span import RecordedSpan, SpanMaker
from proxy.http.tracing import Tracing
from tests.support.otlp_receiver import OtlpReceiver

REMOTE = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                     trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("app", "1")]))
UNSAMPLED_REMOTE = SpanContext(REMOTE.trace_id, REMOTE.span_id, is_remote=True,
                               trace_flags=TraceFlags(TraceFlags.DEFAULT))
# Every kind of value an attribute may hold, and some no collector can take.
VALUES: dict[str, Any] = {
    "text": "memproxy", "empty": "", "unicode": "caf\u00e9 \u2615", "long": "x" * 300,
    "yes": True, "no": False, "zero": 0, "count": 1234567, "negative": -42,
    "int64 max": 2**63 - 1, "int64 min": -(2**63), "beyond int64": 2**64,
    "ratio": 0.25, "zero float": 0.0, "bytes": b"\x00\x01", "texts": ["a", "", "b"],
    "numbers": [1, 2, 3], "flags": [True, False], "floats": [0.5, 1.5], "nothing": None,
}


class Pair:
    """An SDK tracer and memproxy's SpanMaker over one provider and one exporter."""

    def __init__(self, limits: SpanLimits | None = None) -> None:
        self.exported = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "memproxy-test"}),
                                       span_limits=limits)
        processor = SimpleSpanProcessor(self.exported)
        self.provider.add_span_processor(processor)
        self.sdk = self.provider.get_tracer("memproxy")
        self.ours = SpanMaker(self.provider, processor, "memproxy")

    def both(self, act: Callable[[trace.Span], None], *, kind: SpanKind = SpanKind.INTERNAL,
             parent: SpanContext | None = None, links: tuple[Link, ...] = ()) -> tuple[ReadableSpan, ReadableSpan]:
        """The same span made and written by each, once ended: (SDK's, ours)."""
        context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent else None
        for span in (self.sdk.start_span("step", context=context, kind=kind, links=links),
                     self.ours.start("step", context, kind, links=links)):
            act(span)
            span.end()
        sdk_span, own = self.exported.get_finished_spans()[-2:]
        assert isinstance(own, RecordedSpan) and not isinstance(sdk_span, RecordedSpan)
        return sdk_span, own


def comparable(span: ReadableSpan) -> ProtoSpan:
    """The official encoding of `span`, without what differs by design (ids, times)."""
    encoded = _encode_span(span)
    encoded.span_id = b""
    encoded.trace_id = b""
    encoded.start_time_unix_nano = encoded.end_time_unix_nano = 0
    for event in encoded.events:
        event.time_unix_nano = 0
        for attribute in event.attributes:
            if attribute.key == "exception.stacktrace":  # names its own line
                attribute.value.string_value = ""
    return encoded


@pytest.fixture
def pair() -> Iterator[Pair]:
    yield Pair()


def test_our_encoding_of_any_span_is_the_official_one_byte_for_byte(
    pair: Pair, caplog: pytest.LogCaptureFixture,
) -> None:
    def everything(span: trace.Span) -> None:
        span.set_attributes(VALUES)
        span.add_event("first chunk", {"gen_ai.response.time_to_first_chunk": 0.01})
        span.add_event("bare")
        span.set_status(Status(StatusCode.ERROR, "upstream 502"))
        span.update_name("chat gpt-4o-mini")

    link = Link(REMOTE, {"queued.by": "request"})
    spans = [*pair.both(everything, kind=SpanKind.CLIENT, parent=REMOTE, links=(link,)),
             *pair.both(lambda span: span.set_status(StatusCode.OK), kind=SpanKind.SERVER),
             *pair.both(lambda span: None, kind=SpanKind.CONSUMER, links=(Link(REMOTE),))]
    with caplog.at_level(logging.ERROR):
        for span in spans:
            assert encode_span(span) == _encode_span(span).SerializeToString(), span.name
    # The one value no int64 holds is left out by both, and said.
    assert "beyond int64" not in ProtoSpan.FromString(encode_span(spans[1])).attributes.__repr__()
    assert "beyond int64" in caplog.text

    # A whole request: spans of two resources and two scopes, grouped as the official does.
    other = TracerProvider(resource=Resource.create({"service.name": "other"}))
    other.add_span_processor(SimpleSpanProcessor(pair.exported))
    other.get_tracer("elsewhere", "1.0").start_span("theirs").end()
    pair.provider.get_tracer("second scope").start_span("ours too").end()
    batch = list(pair.exported.get_finished_spans())
    ours = ExportTraceServiceRequest.FromString(encode_request(batch))
    official = ExportTraceServiceRequest.FromString(encode_spans(batch).SerializeToString())
    assert ours == official
    assert len(ours.resource_spans) == 2
    assert sorted(len(r.scope_spans) for r in ours.resource_spans) == [1, 2]


@pytest.mark.parametrize("limits", [
    SpanLimits(max_span_attributes=3, max_events=1, max_links=1, max_event_attributes=1),
    SpanLimits(max_span_attribute_length=5, max_attribute_length=4),
    SpanLimits(max_span_attributes=0),
], ids=["counts", "lengths", "no attributes"])
def test_a_recorded_span_keeps_the_sdks_limits(limits: SpanLimits) -> None:
    pair = Pair(limits)

    def write(span: trace.Span) -> None:
        span.set_attributes({"a": "first", "b": "second value", "c": ["long text", "x"]})
        span.set_attribute("d", "fourth")
        span.set_attribute("a", "again")  # moves to the end, drops nothing
        span.add_event("one", {"k": "value", "l": 2})
        span.add_event("two")
        span.add_link(REMOTE)

    sdk_span, own = pair.both(write, links=(Link(REMOTE), Link(UNSAMPLED_REMOTE)))
    assert comparable(own) == comparable(sdk_span)
    assert (own.dropped_attributes, own.dropped_events, own.dropped_links) == \
        (sdk_span.dropped_attributes, sdk_span.dropped_events, sdk_span.dropped_links)


def test_a_recorded_span_takes_nothing_once_ended_and_records_a_failure_as_the_sdk(pair: Pair) -> None:
    def fail(span: trace.Span) -> None:
        span.set_attribute("before", 1)
        try:
            with trace.use_span(span, end_on_exit=False):
                raise ValueError("recall failed")
        except ValueError:
            pass

    sdk_span, recorded = pair.both(fail)
    assert isinstance(recorded, RecordedSpan)
    own = recorded
    assert own.status.status_code is StatusCode.ERROR
    assert [event.name for event in own.events] == ["exception"]
    assert comparable(own) == comparable(sdk_span)
    ended = own.end_time
    own.set_attribute("after", 2)
    own.set_attributes({"later": 3})
    own.add_event("late")
    own.set_status(StatusCode.OK)
    own.update_name("renamed")
    own.end()
    assert (own.name, own.end_time, own.status.status_code) == ("step", ended, StatusCode.ERROR)
    assert set(own.attributes or {}) == {"before"} and len(own.events) == 1
    assert len(pair.exported.get_finished_spans()) == 2  # ended once


@pytest.mark.parametrize("sampler", [
    "parentbased_always_on", "parentbased_always_off", "always_on", "always_off",
    "traceidratio", "parentbased_traceidratio",
])
def test_sampling_decides_as_the_sdk_does(sampler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    pair = Pair()
    for parent in (None, REMOTE, UNSAMPLED_REMOTE):
        context = trace.set_span_in_context(NonRecordingSpan(parent)) if parent else None
        for _ in range(20):  # new trace ids: the ratio samplers decide both ways
            root = pair.ours.start("root", context, SpanKind.SERVER)
            made = root.get_span_context()
            if parent is None:  # a new trace: the SDK's decision on the same trace id
                decided = pair.provider.sampler.should_sample(None, made.trace_id, "root", SpanKind.SERVER)
                assert root.is_recording() == decided.decision.is_recording()  # type: ignore[no-untyped-call]
                assert made.trace_flags.sampled == decided.decision.is_sampled()  # type: ignore[no-untyped-call]
                same = pair.sdk.start_span("root", None, kind=SpanKind.SERVER)
                if same.get_span_context().trace_flags.sampled == made.trace_flags.sampled:
                    assert made.trace_flags == same.get_span_context().trace_flags
                same.end()
            else:  # the client's trace goes on, decided as the SDK decides it
                same = pair.sdk.start_span("root", context, kind=SpanKind.SERVER)
                assert root.is_recording() == same.is_recording(), (sampler, parent)
                assert made.trace_flags == same.get_span_context().trace_flags
                assert (made.trace_id, made.trace_state) == (parent.trace_id, parent.trace_state)
                same.end()
            # A child of a sampled span of this process is sampled, as the SDK samples it.
            if made.trace_flags.sampled:
                child = pair.ours.child("child", made, {"n": 1})
                sdk_child = pair.sdk.start_span("child", trace.set_span_in_context(root))
                assert child.is_recording() and sdk_child.is_recording()
                assert child.get_span_context().trace_flags == sdk_child.get_span_context().trace_flags
                assert isinstance(child, RecordedSpan) and child.parent == made
                child.end()
                sdk_child.end()
            else:  # and a child of one sampled out is not, with the same flags and state
                client = pair.ours.begin("client", made, SpanKind.CLIENT, {"n": 1})
                sdk_client = pair.sdk.start_span("client", trace.set_span_in_context(root), kind=SpanKind.CLIENT)
                assert not client.is_recording() and not sdk_client.is_recording()
                own, theirs = client.get_span_context(), sdk_client.get_span_context()
                assert (own.trace_id, own.trace_flags, own.trace_state, own.is_remote) == \
                    (theirs.trace_id, theirs.trace_flags, theirs.trace_state, theirs.is_remote)
                assert own.is_valid and own.span_id != made.span_id
                assert type(own) is SpanContext and tuple(own) == tuple(SpanContext(
                    own.trace_id, own.span_id, False, own.trace_flags, own.trace_state))
            root.end()


class ZeroSpanIds(RandomIdGenerator):
    """An id generator that gives the invalid span id 0."""

    def generate_span_id(self) -> int:
        return 0


def test_a_span_context_made_without_its_checks_is_the_one_its_constructor_makes(pair: Pair) -> None:
    root = pair.ours.start("root", None, SpanKind.SERVER)
    child = pair.ours.child("child", root.get_span_context(), None)
    remote_child = pair.ours.start("remote child", trace.set_span_in_context(NonRecordingSpan(REMOTE)))
    for span in (root, child, remote_child):
        made = span.get_span_context()
        same = SpanContext(made.trace_id, made.span_id, is_remote=False, trace_flags=made.trace_flags,
                           trace_state=made.trace_state)
        assert type(made) is SpanContext and tuple(made) == tuple(same) and made.is_valid
    assert remote_child.get_span_context().trace_state == REMOTE.trace_state
    # An id the constructor would find invalid is left to it, and is invalid.
    provider = TracerProvider(id_generator=ZeroSpanIds())
    maker = SpanMaker(provider, SimpleSpanProcessor(InMemorySpanExporter()), "memproxy")
    # ... for a span that records, and for the child of one sampled out.
    unsampled = pair.ours.start("unsampled", trace.set_span_in_context(NonRecordingSpan(UNSAMPLED_REMOTE)))
    for span in (maker.start("root"), maker.child("child", root.get_span_context(), None),
                 maker.begin("client", unsampled.get_span_context(), SpanKind.CLIENT)):
        made = span.get_span_context()
        assert not made.is_valid
        assert tuple(made) == tuple(SpanContext(made.trace_id, 0, False, made.trace_flags, made.trace_state))


def test_ended_spans_reach_the_batch_queue_as_its_own_emit_puts_them(caplog: pytest.LogCaptureFixture) -> None:
    """RecordedSpans go into a BatchSpanProcessor's queue themselves (recorded_span._ender),
    with what its `emit` does at the edges: the span that makes a batch wakes the exporter's
    thread, a full queue drops the span with the SDK's warning, a shut-down one takes none."""
    exported = InMemorySpanExporter()
    processor = BatchSpanProcessor(exported, max_queue_size=6, max_export_batch_size=4,
                                   schedule_delay_millis=600_000)  # no timed export in this test
    maker = SpanMaker(TracerProvider(), processor, "memproxy")
    for number in range(3):
        maker.start(f"step {number}").end()
    assert len(processor._batch_processor._queue) == 3 and not exported.get_finished_spans()
    maker.start("step 3").end()  # the fourth makes a batch: exported without waiting the delay
    for _ in range(500):
        if len(exported.get_finished_spans()) == 4:
            break
        threading.Event().wait(0.01)
    assert [span.name for span in exported.get_finished_spans()] == [f"step {n}" for n in range(4)]

    # Full: with the exporter's thread held (it waits for the export lock), the queue takes
    # six and drops the seventh, saying so.
    with processor._batch_processor._export_lock, caplog.at_level(logging.WARNING):
        for number in range(7):
            maker.start(f"held {number}").end()
        assert len(processor._batch_processor._queue) == 6
        assert "Queue full, dropping Span" in caplog.text
    processor.shutdown()  # type: ignore[no-untyped-call]
    assert {span.name for span in exported.get_finished_spans()} >= {f"held {n}" for n in range(1, 7)}
    before = len(exported.get_finished_spans())
    maker.start("after").end()  # shut down: not queued
    assert not processor._batch_processor._queue and len(exported.get_finished_spans()) == before


def test_the_exporter_sends_what_a_collector_decodes_and_keeps_the_exporters_settings(
    pair: Pair, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pair.both(lambda span: span.set_attributes({"text": "memproxy", "count": 3}), kind=SpanKind.SERVER)
    spans = list(pair.exported.get_finished_spans())
    with OtlpReceiver() as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-key=secret")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        exporter = FastOTLPSpanExporter()
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        received = collector.wait_for(lambda s: s.name == "step")
        assert [s.attributes for s in received] == [{"text": "memproxy", "count": 3}] * 2
        assert all(s.kind == "SERVER" and s.resource["service.name"] == "memproxy-test" for s in received)
        sent = collector.requests[-1]
        assert sent.headers["x-collector-key"] == "secret"
        assert sent.headers["content-encoding"] == "gzip"
        assert ExportTraceServiceRequest.FromString(gzip.decompress(sent.body)) == \
            ExportTraceServiceRequest.FromString(encode_spans(spans).SerializeToString())
        # Over its size limit, a batch is dropped, not sent; once shut down, nothing is.
        assert FastOTLPSpanExporter(max_request_size=10).export(spans) is SpanExportResult.FAILURE
        exporter.shutdown()  # type: ignore[no-untyped-call]
        assert exporter.export(spans) is SpanExportResult.FAILURE
        assert collector.exports == 1


def test_the_exporter_goes_through_the_environments_proxy_with_its_netrc_credentials(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """What requests reads from the environment on each request (proxies, NO_PROXY, ~/.netrc),
    the exporter reads once when made (otlp_export.settle_environment), to the same effect."""
    pair.both(lambda span: None)
    spans = list(pair.exported.get_finished_spans())
    netrc = tmp_path / "netrc"
    netrc.write_text("machine collector.test login ada password s3cret\n")
    netrc.chmod(0o600)
    for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(netrc))
    with OtlpReceiver() as forward_proxy, OtlpReceiver() as collector:
        monkeypatch.setenv("http_proxy", forward_proxy.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector.test:4318/v1/traces")
        proxied = FastOTLPSpanExporter()
        # NO_PROXY names the collector: straight to it, though the proxy variable is set.
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{collector.endpoint}/v1/traces")
        direct = FastOTLPSpanExporter()
        assert proxied.export(spans) is SpanExportResult.SUCCESS
        assert direct.export(spans) is SpanExportResult.SUCCESS
        for exporter in (proxied, direct):
            exporter.shutdown()  # type: ignore[no-untyped-call]  # its kept-alive connection
    assert forward_proxy.exports == 1 and collector.exports == 1
    sent = forward_proxy.requests[0].headers
    assert sent["host"] == "collector.test:4318"
    assert sent["authorization"] == "Basic " + base64.b64encode(b"ada:s3cret").decode()
    assert "authorization" not in collector.requests[0].headers  # no netrc entry for it
    assert len(collector.spans) == len(spans)


def test_memproxys_current_span_goes_into_tasks_and_only_roots_are_opentelemetrys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    processor = BatchSpanProcessor(exported)
    provider.add_span_processor(processor)
    tracing = Tracing(provider, processor, capture=False, redact=str)
    seen: dict[str, Any] = {}

    async def after_the_step() -> None:
        await asyncio.sleep(0.01)  # the step that started this task has ended by now
        seen["queued by"] = tracing.traceparent()
        with tracing.span("later") as later:
            assert later is not None

    async def job() -> None:
        assert tracing.log_ids() == {} and tracing.traceparent() is None
        with tracing.linked("job", [f"00-{REMOTE.trace_id:032x}-{REMOTE.span_id:016x}-01"]) as root:
            assert trace.get_current_span() is root  # a root is OpenTelemetry's current span too
            with tracing.span("step", {"n": 1}) as step:
                assert step is not None and trace.get_current_span() is root  # a step is not
                assert not tracing.drops_children()
                ids = step.get_span_context()
                assert tracing.log_ids() == {"trace_id": f"{ids.trace_id:032x}", "span_id": f"{ids.span_id:016x}"}
                task = asyncio.get_running_loop().create_task(after_the_step())
            await task
        assert trace.get_current_span() is INVALID_SPAN and tracing.traceparent() is None

    asyncio.run(job())
    processor.force_flush()
    spans = {span.name: span for span in exported.get_finished_spans()}
    root, step, later = spans["job"], spans["step"], spans["later"]
    assert root.parent is None and [link.context.span_id for link in root.links] == [REMOTE.span_id]
    assert step.parent == root.context and later.parent == step.context
    assert seen["queued by"] == f"00-{step.context.trace_id:032x}-{step.context.span_id:016x}-03"
    assert later.start_time is not None and step.end_time is not None and later.start_time > step.end_time

    # Sampled out, a root's steps are not made, in the tasks it starts neither.
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    unsampled = TracerProvider()
    tracing = Tracing(unsampled, processor, capture=False, redact=str)

    async def sampled_out() -> None:
        with tracing.linked("job", []) as root:
            assert not root.is_recording() and tracing.traceparent() is None
            assert tracing.drops_children()  # what a CLIENT span under it sees, so
            assert tracing.log_ids()  # still a trace, for the log lines
            with tracing.span("step") as step:
                assert step is None
            await asyncio.get_running_loop().create_task(after_sampled_out())

    async def after_sampled_out() -> None:
        with tracing.span("later") as later:
            assert later is None

    asyncio.run(sampled_out())
