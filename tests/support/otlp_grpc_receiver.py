"""An OTLP/gRPC trace receiver on 127.0.0.1: the TraceService of opentelemetry-proto's
generated stubs, served by grpcio, keeping what it receives as the OTLP/HTTP receiver does::

    with GrpcOtlpReceiver() as collector:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector.endpoint
        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.support.otlp_receiver import OtlpReceiver


class GrpcOtlpReceiver(OtlpReceiver):
    """The collector over gRPC: started on enter, stopped on exit."""

    def __init__(self) -> None:
        super().__init__()
        self._grpc: grpc.Server | None = None
        self._grpc_port = 0

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT gets (http: no TLS, as the exporter reads it)."""
        return f"http://127.0.0.1:{self._grpc_port}"

    def __enter__(self) -> GrpcOtlpReceiver:
        receiver = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
                metadata = {key: value for key, value in context.invocation_metadata()}
                receiver.record("/v1/traces", metadata, request.SerializeToString())
                return ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            TraceService(), self._grpc)
        self._grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._grpc is not None
        self._grpc.stop(grace=None)
