"""An OTLP/HTTP trace receiver on 127.0.0.1: what a collector gets from memproxy.

It decodes each `POST /v1/traces` (an ExportTraceServiceRequest in protobuf) with
opentelemetry-proto and keeps the spans, flattened::

    with OtlpReceiver() as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
        ...
        server = collector.wait_for(lambda s: s.kind == "SERVER")

`delay` makes a slow collector (each export waits that long before its answer); a stdlib
threading server, so a sleeping export holds only its own thread.
"""

from __future__ import annotations

import argparse
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, its ids as lowercase hex."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    status: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int
    resource: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReceivedExport:
    """One export request: its headers (names in lowercase) and its body as sent."""

    headers: dict[str, str]
    body: bytes


class OtlpReceiver:
    """The collector: started on enter, stopped on exit."""

    def __init__(self, *, delay: float = 0.0, port: int = 0, keep: bool = True,
                 decode: bool = True) -> None:
        self.delay = delay
        self.port = port
        self.keep = keep  # False: count the spans, keep none (the benchmark's long runs)
        # False: count exports and bytes only. The benchmark's collector: decoding takes the
        # CPU the measured proxy shares on a small machine (a real collector runs elsewhere).
        self.decode = decode
        self.count = 0
        self.exports = 0  # requests received, decoded or not
        self.bytes = 0
        self._spans: list[ReceivedSpan] = []
        self.requests: list[ReceivedExport] = []  # each export as it came (when keeping)
        self._cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT gets (the exporter adds /v1/traces)."""
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, as a collector's OTLP/HTTP endpoint: HTTP/1.0's connection a
            # request would cost the exporter a TCP handshake every export.
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver.record(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                if receiver.delay:
                    time.sleep(receiver.delay)
                answer = ExportTraceServiceResponse().SerializeToString()
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                    self.send_header("content-length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:
                    pass  # the exporter gave up waiting

            def do_GET(self) -> None:  # readiness, and how many spans came
                answer = (f'{{"exports": {receiver.exports}, "bytes": {receiver.bytes},'
                          f' "spans": {receiver.count}}}').encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    def record(self, path: str, headers: dict[str, str], body: bytes) -> None:
        """Keep one export request (decoded unless `decode` is off)."""
        sent = gzip.decompress(body) if headers.get("content-encoding") == "gzip" and self.decode else body
        spans = decode(sent) if path == "/v1/traces" and self.decode else []
        with self._cond:
            self.exports += 1
            self.bytes += len(body)
            self.count += len(spans)
            if self.keep:
                self._spans.extend(spans)
                self.requests.append(ReceivedExport(headers, body))
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far."""
        with self._cond:
            return list(self._spans)

    def wait_for(
        self, match: Callable[[ReceivedSpan], bool], *, count: int = 1, timeout: float = 15.0
    ) -> list[ReceivedSpan]:
        """The spans that match, once at least `count` did; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [span for span in self._spans if match(span)]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(found)} of {count} spans; got "
                                       f"{sorted({s.name for s in self._spans})}")
                self._cond.wait(left)


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ExportTraceServiceRequest."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(ReceivedSpan(
                    name=span.name, kind=KINDS.get(span.kind, str(span.kind)),
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex(), attributes=_attributes(span.attributes),
                    events=[(event.name, _attributes(event.attributes)) for event in span.events],
                    links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                    status=span.status.code, start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano, resource=resource,
                ))
    return out


def _attributes(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in pairs:
        assert isinstance(pair, KeyValue)
        found[pair.key] = _value(pair.value)
    return found


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {item.key: _value(item.value) for item in value.kvlist_value.values}
    return getattr(value, kind) if kind is not None else None


def main() -> None:
    """`python -m tests.support.otlp_receiver --port N`: a collector for the benchmarks
    (scripts/bench_overhead.py --tracing) that decodes every export and keeps a count;
    with --count-only it counts exports and bytes and decodes nothing."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count-only", action="store_true")
    args = parser.parse_args()
    with OtlpReceiver(port=args.port, keep=False, decode=not args.count_only):
        threading.Event().wait()


if __name__ == "__main__":
    main()
