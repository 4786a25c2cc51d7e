"""Who configures OpenTelemetry (proxy/http/telemetry.py, docs/tracing.md): memproxy's own
provider, made from the OTEL_* variables, exporting over OTLP/HTTP or gRPC; or a provider
that an outer program set globally first, which memproxy uses and adds nothing to. The API
allows one global provider a process, so each case runs memproxy in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from config import SettingsError, load_settings
from tests.support.otlp_grpc_receiver import GrpcOtlpReceiver
from tests.support.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[1]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
# memproxy in a process: an outer program's provider first (`outer`), or that and an ASGI
# instrumentation around the app (`asgi`), or none (`own`: memproxy's, from the variables).
PROGRAM = """
import json, sys, time
from starlette.testclient import TestClient
from config import load_settings
from proxy.app import create_app
from tests.support.scripted_upstream import ScriptedUpstream

mode, data_dir, requests = sys.argv[1], sys.argv[2], int(sys.argv[3])
exported = None
if mode in ("outer", "asgi"):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    trace.set_tracer_provider(provider)

with ScriptedUpstream() as up:
    settings = load_settings(env={"MEMPROXY_UPSTREAM_BASE_URL": up.base_url,
                                  "MEMPROXY_DATA_DIR": data_dir, "MEMPROXY_LOG_FORMAT": "json"})
    app = create_app(settings, with_memory=False)
    if mode == "asgi":
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        app = OpenTelemetryMiddleware(app)
    client = TestClient(app, base_url="http://127.0.0.1")
    with client:
        for n in range(requests):
            reply = client.post("/v1/chat/completions", headers={"traceparent": sys.argv[4]},
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200, reply.text
        stopping = time.monotonic()
    spans = [{"name": s.name, "kind": s.kind.name, "trace_id": f"{s.context.trace_id:032x}",
              "span_id": f"{s.context.span_id:016x}",
              "parent_id": f"{s.parent.span_id:016x}" if s.parent else ""}
             for s in (exported.get_finished_spans() if exported is not None else [])]
    print(json.dumps({"upstream": [r.headers.get("traceparent") for r in up.history],
                      "spans": spans, "stopped_in": time.monotonic() - stopping}))
"""


def run(mode: str, tmp_path: Path, otel: dict[str, str], *, requests: int = 1) -> tuple[dict[str, Any], str]:
    """Run PROGRAM; what it printed, and its standard error (the log lines)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode, str(tmp_path), str(requests), CLIENT_PARENT],
        cwd=ROOT, env={**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **otel},
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def own(endpoint: str, **more: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "memproxy-own",
            "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": "5", **more}


@pytest.mark.process
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_memproxys_own_provider_exports_with_the_protocol_the_variables_choose(
    tmp_path: Path, protocol: str,
) -> None:
    receiver = GrpcOtlpReceiver() if protocol == "grpc" else OtlpReceiver()
    with receiver:
        printed, _ = run("own", tmp_path, own(receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                                              OTEL_EXPORTER_OTLP_HEADERS="x-collector-key=k1"))
        server = receiver.wait_for(lambda s: s.kind == "SERVER")[0]
        call = receiver.wait_for(lambda s: s.kind == "CLIENT")[0]
    assert (server.trace_id, server.name) == (CLIENT_TRACE, "POST /v1/chat/completions")
    assert server.resource["service.name"] == "memproxy-own"  # OTEL_SERVICE_NAME, read by the SDK
    assert call.parent_id == server.span_id
    assert call.attributes["gen_ai.request.model"] == "m"
    assert printed["upstream"] == [f"00-{CLIENT_TRACE}-{call.span_id}-01"]
    assert receiver.requests[-1].headers["x-collector-key"] == "k1"  # the exporter's own variable


@pytest.mark.process
def test_the_sdks_sampler_variables_decide(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        printed, _ = run("own", tmp_path, own(receiver.endpoint, OTEL_TRACES_SAMPLER="always_off"),
                         requests=3)
    assert receiver.spans == []
    # Sampled out, the trace still goes on upstream, through memproxy's span, unsampled.
    assert {tuple(sent.split("-")[1::2]) for sent in printed["upstream"]} == {(CLIENT_TRACE, "00")}


@pytest.mark.process
def test_under_a_global_provider_memproxy_configures_nothing_and_its_processor_sees_the_spans(
    tmp_path: Path,
) -> None:
    with OtlpReceiver() as receiver:  # named by the variables too: memproxy must not export
        printed, _ = run("outer", tmp_path, own(receiver.endpoint))
    assert receiver.exports == 0
    spans = {span["name"]: span for span in printed["spans"]}
    server, call = spans["POST /v1/chat/completions"], spans["chat m"]
    assert (server["kind"], server["trace_id"]) == ("SERVER", CLIENT_TRACE)
    assert (call["kind"], call["parent_id"]) == ("CLIENT", server["span_id"])
    assert printed["upstream"] == [f"00-{CLIENT_TRACE}-{call['span_id']}-01"]


@pytest.mark.process
def test_under_an_asgi_instrumentations_server_span_memproxys_span_is_its_child(tmp_path: Path) -> None:
    printed, _ = run("asgi", tmp_path, {})
    servers = [span for span in printed["spans"] if span["kind"] == "SERVER"]
    assert len(servers) == 1 and servers[0]["trace_id"] == CLIENT_TRACE  # the instrumentation's
    ours = next(span for span in printed["spans"] if span["name"] == "POST /v1/chat/completions"
                and span["kind"] == "INTERNAL")
    assert ours["parent_id"] == servers[0]["span_id"]
    call = next(span for span in printed["spans"] if span["kind"] == "CLIENT" and span["name"] == "chat m")
    assert call["parent_id"] == ours["span_id"]


@pytest.mark.process
def test_a_collector_that_is_down_holds_no_request_nor_the_shutdown_and_logs_json(
    tmp_path: Path,
) -> None:
    with OtlpReceiver() as gone:
        endpoint = gone.endpoint  # a port nothing listens on once it is closed
    # The export would wait 30 s for it; the shutdown gives it 5 at most.
    printed, stderr = run("own", tmp_path, own(endpoint, OTEL_EXPORTER_OTLP_TIMEOUT="30"), requests=5)
    assert len(printed["upstream"]) == 5
    assert printed["stopped_in"] < 10
    lines = [line for line in stderr.splitlines() if line.strip()]
    logged = [json.loads(line) for line in lines]  # each line one JSON object, the SDK's too
    assert [entry for entry in logged if entry["logger"].startswith("opentelemetry")], lines


@pytest.mark.parametrize(("name", "value"), [
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "localhost:4318/v1/traces"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
    ("OTEL_TRACES_EXPORTER", "zipkin"),
    ("OTEL_PROPAGATORS", "tracecontext,b3"),
])
def test_otel_variables_tracing_cannot_use_fail_with_the_settings(name: str, value: str) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings(env={name: value})
    assert f"{name}: " in str(raised.value)
    load_settings(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example:4318",
                       "OTEL_PROPAGATORS": "tracecontext,baggage", "OTEL_TRACES_EXPORTER": "otlp"})
