"""The OpenTelemetry SDK, configured in this one place at start-up (docs/tracing.md).

Everything else in memproxy uses only the API (`trace.get_tracer(__name__)`), as an
instrumented library does; this module decides which provider those tracers reach:

- a TracerProvider that someone set globally first (`opentelemetry-instrument`, an
  embedding application) is used as it is, and memproxy configures nothing;
- otherwise, with an OTLP endpoint set, memproxy makes the SDK's TracerProvider with its
  BatchSpanProcessor and the exporter OTEL_TRACES_EXPORTER and OTEL_EXPORTER_OTLP_PROTOCOL
  choose, sets it globally, and shuts it down when the app stops;
- otherwise nothing traces, and the API's tracers stay no-ops.

The SDK reads its own OTEL_* variables (sampler, batch sizes, limits, headers, timeouts);
config/otel.py checks the ones that would otherwise fail only at the first export.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace

from config.otel import ENDPOINTS

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

@dataclass(frozen=True)
class Provider:
    """Which provider traces: `traced` whether any does; `owned` the one memproxy made
    (to shut down), None when there is none or it is someone else's."""

    traced: bool
    owned: TracerProvider | None = None

    async def shutdown(self, timeout: float) -> None:
        """Export what is left of memproxy's own provider, waiting up to `timeout` seconds
        (the export goes on in a daemon thread: a collector that is down costs no more)."""
        if self.owned is None:
            return
        stopping = threading.Thread(target=self.owned.shutdown, name="otel-shutdown", daemon=True)
        stopping.start()
        await asyncio.to_thread(stopping.join, timeout)


def configure(environ: Mapping[str, str]) -> Provider:
    """Use the global provider if one is set, else make memproxy's own when an OTLP
    endpoint is set (see the module's docstring)."""
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return Provider(traced=True)
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    if disabled or exporter == "none" or not any(environ.get(name, "").strip() for name in ENDPOINTS):
        return Provider(traced=False)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; memproxy names
    # the service only when they do not. The sampler comes from OTEL_TRACES_SAMPLER(_ARG).
    # The lifespan shuts the provider down, bounded, instead of an atexit hook that would
    # wait for a collector that is down.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "memproxy"}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_exporter(_protocol(environ))))  # OTEL_BSP_*
    trace.set_tracer_provider(provider)
    return Provider(traced=True, owned=provider)


def _protocol(environ: Mapping[str, str]) -> str:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if chosen := environ.get(name, "").strip():
            return chosen
    return "http/protobuf"


def _exporter(protocol: str) -> SpanExporter:
    """The official OTLP exporter for `protocol`; it reads its OTEL_EXPORTER_OTLP_* itself."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HTTPSpanExporter,
    )

    return HTTPSpanExporter()

