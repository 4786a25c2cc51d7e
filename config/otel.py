"""The OTEL_* variables memproxy's tracing depends on, checked with the settings
(docs/tracing.md): the SDK and its exporters read them only when they export or import, so
a mistake would otherwise fail on every export, or crash the first import, not at start."""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from urllib.parse import urlsplit

ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
PROTOCOLS = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
EXPORTERS = frozenset({"otlp", "none"})
SUPPORTED_PROTOCOLS = frozenset({"http/protobuf", "grpc"})


def otel_errors(env: Mapping[str, str]) -> list[str]:
    """One line for each OTEL_* variable memproxy's tracing could not work with."""
    errors = [f"{name}: {value!r} needs a scheme and a host, such as http://localhost:4318"
              for name in ENDPOINTS if (value := env.get(name, "").strip()) and not _is_url(value)]
    errors += [f"{name}: {value!r} is not one of http/protobuf, grpc" for name in PROTOCOLS
               if (value := env.get(name, "").strip()) not in {"", *SUPPORTED_PROTOCOLS}]
    exporters = {part.strip().lower() for part in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    if unknown := sorted(exporters - EXPORTERS - {""}):
        errors.append(f"OTEL_TRACES_EXPORTER: memproxy exports with otlp (or none), not {', '.join(unknown)}")
    errors += _propagator_errors(env.get("OTEL_PROPAGATORS", ""))
    return errors


def _is_url(value: str) -> bool:
    address = urlsplit(value)
    return address.scheme in ("http", "https") and bool(address.hostname)


def _propagator_errors(configured: str) -> list[str]:
    """OTEL_PROPAGATORS names that no installed package provides: the API raises on them
    when it is first imported."""
    names = [name.strip() for name in configured.split(",") if name.strip()]
    installed = {point.name for point in entry_points(group="opentelemetry_propagator")}
    missing = [name for name in names if name.lower() != "none" and name not in installed]
    return [f"OTEL_PROPAGATORS: {', '.join(missing)} not installed (installed: "
            f"{', '.join(sorted(installed))}, or none)"] if missing else []
