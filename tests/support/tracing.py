"""The test process as an outer program that configured OpenTelemetry before memproxy:
one TracerProvider, set globally the first time a test asks (the API allows one a
process), which memproxy then uses instead of making its own (proxy/http/telemetry.py)::

    with OtlpReceiver() as receiver, collecting(receiver.endpoint):
        proxy = start_proxy()  # its spans reach the receiver over OTLP/HTTP

Between tests the provider samples nothing and exports nowhere; during one, it samples with
the test's sampler and exports to the test's receiver with the SDK's batch processor. So a
worker process that ran a tracing test runs its later apps traced but sampled out: they
still send an unsampled `traceparent` upstream. Tests of memproxy's own provider, and of
none, run memproxy in a process of their own (tests/test_tracing_setup.py).
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Iterator, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, DEFAULT_ON, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

SERVICE = "memproxy-under-test"


class TestSampler(Sampler):
    """The current test's sampler (none between tests: ALWAYS_OFF)."""

    def __init__(self) -> None:
        self.chosen: Sampler = ALWAYS_OFF

    def should_sample(
        self, parent_context: Context | None, trace_id: int, name: str,
        kind: SpanKind | None = None, attributes: Attributes = None,
        links: Sequence[Link] | None = None, trace_state: TraceState | None = None,
    ) -> SamplingResult:
        return self.chosen.should_sample(parent_context, trace_id, name, kind, attributes,
                                         links, trace_state)

    def get_description(self) -> str:
        return f"test({self.chosen.get_description()})"


class TestProcessor(SpanProcessor):
    """Hands ended spans to the current test's processor (none between tests)."""

    def __init__(self) -> None:
        self.chosen: SpanProcessor | None = None

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if (chosen := self.chosen) is not None:
            chosen.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if (chosen := self.chosen) is not None:
            chosen.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        chosen = self.chosen
        return True if chosen is None else chosen.force_flush(timeout_millis)


class OwnRandomIds(IdGenerator):
    """Random ids from a generator of the provider's own. The SDK's default draws from the
    `random` module's global state, which the property-based tests watch: a span made by a
    server thread while Hypothesis draws an example is taken for a strategy using it."""

    def __init__(self) -> None:
        self._random = random.Random()

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1  # 0 is the invalid id

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


@functools.cache
def outer_provider() -> tuple[TracerProvider, TestSampler, TestProcessor]:
    """The process's global provider, set on the first call."""
    sampler, processor = TestSampler(), TestProcessor()
    provider = TracerProvider(sampler=sampler, resource=Resource.create({"service.name": SERVICE}),
                              shutdown_on_exit=False, id_generator=OwnRandomIds())
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider, sampler, processor


@contextlib.contextmanager
def collecting(endpoint: str, sampler: Sampler = DEFAULT_ON) -> Iterator[TracerProvider]:
    """Sample with `sampler` and export to the OTLP/HTTP receiver at `endpoint` until the
    block ends (then what is left is flushed)."""
    provider, chosen_sampler, chosen = outer_provider()
    exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=2)
    processor = BatchSpanProcessor(exporter, schedule_delay_millis=50)
    chosen_sampler.chosen, chosen.chosen = sampler, processor
    try:
        yield provider
    finally:
        chosen_sampler.chosen, chosen.chosen = ALWAYS_OFF, None
        processor.shutdown()  # type: ignore[no-untyped-call]
