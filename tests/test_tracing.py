"""OpenTelemetry traces (docs/tracing.md), as a collector receives them: a real OTLP/HTTP
receiver on 127.0.0.1 decodes what memproxy exports, and the scripted upstream shows what
it was sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from config import Route
from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.scripted_upstream import (
    JSONReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)
from tests.support.tracing import collecting

ROOT = Path(__file__).resolve().parents[1]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_HEADERS = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "app=1"}
SECRET = "sk-proj-" + "Zq9" * 16  # a key the redaction knows


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """A receiver that gets the spans of this test's memproxy, every request sampled."""
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    with OtlpReceiver() as receiver, collecting(receiver.endpoint):
        yield receiver


def chat_client(proxy: RunningProxy, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0,
                         default_headers=headers or {})


def one(spans: list[ReceivedSpan], name: str, **where: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and all(getattr(s, k) == v for k, v in where.items())]
    assert len(found) == 1, (name, where, [(s.name, s.parent_id) for s in spans])
    return found[0]


def server_span(collector: OtlpReceiver, route: str, trace_id: str | None = None) -> ReceivedSpan:
    def match(span: ReceivedSpan) -> bool:
        return span.kind == "SERVER" and span.attributes.get("http.route") == route \
            and (trace_id is None or span.trace_id == trace_id)

    return collector.wait_for(match)[-1]


def trace_of(collector: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    return [s for s in collector.spans if s.trace_id == trace_id]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


@pytest.mark.both_backends
def test_a_chat_completion_is_one_trace_from_the_client_to_the_upstream(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    backend: str,
) -> None:
    proxy = start_proxy(memory=True)
    client = chat_client(proxy)
    client.chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": "My dog is called Rex and he loves the beach."}])
    wait_for_jobs(proxy)
    traced = chat_client(proxy, CLIENT_HEADERS)
    traced.chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": "What is my dog called?"}])
    wait_for_jobs(proxy)

    server = server_span(collector, "/v1/chat/completions", CLIENT_TRACE)
    # The client's trace goes on: same trace id, the client's span is the parent.
    assert (server.trace_id, server.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert server.name == "POST /v1/chat/completions"
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["url.path"] == "/v1/chat/completions"
    assert server.resource["service.name"] == "memproxy-under-test"

    collector.wait_for(lambda s: s.name == "memproxy.remember.reply" and s.trace_id == CLIENT_TRACE)
    spans = trace_of(collector, CLIENT_TRACE)
    under = children(spans, server)
    assert {"memproxy.recall", "chat gpt-4o-mini", "memproxy.remember.request",
            "memproxy.remember.reply"} <= set(under), sorted(under)

    recall = under["memproxy.recall"]
    assert recall.attributes["memproxy.recall.items"] >= 1
    assert recall.attributes["memproxy.recall.injected_tokens"] > 0
    assert recall.attributes["memproxy.recall.candidates"] >= recall.attributes["memproxy.recall.items"]
    assert recall.attributes["memproxy.recall.budget"] > 0
    assert recall.attributes["memproxy.recall.scope"] == proxy.state.settings.memory_scope
    assert recall.attributes["memproxy.recall.cache_hit"] is False
    steps = children(spans, recall)
    assert {"memproxy.recall.embed_query", "memproxy.recall.dense_search",
            "lexical_search chunks", "memproxy.recall.rank",
            "stamp memory_versions"} <= set(steps), sorted(steps)
    assert steps["memproxy.recall.dense_search"].attributes["memproxy.recall.candidates"] >= 1
    # Ranking and packing are one span; the learned items found (none yet) are counted there.
    ranked = steps["memproxy.recall.rank"]
    assert ranked.attributes["memproxy.recall.candidates"] >= recall.attributes["memproxy.recall.items"]
    assert ranked.attributes["memproxy.recall.learned"] == 0
    assert ranked.end_ns <= recall.end_ns
    # The database steps of recall, on this backend.
    system = {"sqlite": "sqlite", "postgres": "postgresql"}[backend]
    lexical = steps["lexical_search chunks"]
    assert lexical.attributes["db.system.name"] == system
    assert lexical.attributes["db.operation.name"] == "lexical_search"
    assert lexical.attributes["memproxy.recall.candidates"] >= 1
    assert steps["stamp memory_versions"].attributes["db.system.name"] == system
    # Rows ranking reads besides (those only the vectors found, neighbours): a span each time.
    reads = [s for s in children(spans, steps["memproxy.recall.rank"]).values() if s.name == "read chunks"]
    assert all(s.attributes["db.system.name"] == system for s in reads)

    upstream_call = under["chat gpt-4o-mini"]
    assert upstream_call.kind == "CLIENT"
    assert upstream_call.attributes["gen_ai.operation.name"] == "chat"
    assert upstream_call.attributes["gen_ai.provider.name"] == "openai"
    assert upstream_call.attributes["gen_ai.request.model"] == "gpt-4o-mini"
    assert upstream_call.attributes["gen_ai.response.model"] == "gpt-4o-mini"
    assert upstream_call.attributes["gen_ai.usage.input_tokens"] > 0
    assert upstream_call.attributes["gen_ai.usage.output_tokens"] > 0
    assert upstream_call.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert upstream_call.attributes["server.address"] == "127.0.0.1"
    # The upstream continues memproxy's CLIENT span, not the client's header as it came.
    sent = upstream.history[-1].headers
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{upstream_call.span_id}-01"
    assert sent["tracestate"] == "app=1"

    # The index job of the request's turns: a trace of its own, linked to the request.
    remembered = under["memproxy.remember.request"]
    job = collector.wait_for(lambda s: s.name == "memproxy.job index"
                             and (CLIENT_TRACE, remembered.span_id) in s.links)[0]
    assert job.kind == "CONSUMER" and job.parent_id == "" and job.trace_id != CLIENT_TRACE
    assert job.attributes["memproxy.job.kind"] == "index"
    # No message text on any span by default.
    assert not [s for s in collector.spans if any(k.startswith("gen_ai.input") or
                                                  k.startswith("gen_ai.output") for k in s.attributes)]
    assert not [s for s in collector.spans if "Rex" in json.dumps(s.attributes)]


def test_a_streamed_call_ends_its_span_at_the_last_byte(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy()
    stream = chat_client(proxy, CLIENT_HEADERS).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Tell me a story"}], stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.startswith("echo: ")

    server = server_span(collector, "/v1/chat/completions", CLIENT_TRACE)
    upstream_call = collector.wait_for(lambda s: s.kind == "CLIENT" and s.parent_id == server.span_id)[0]
    # Counted from the call's start: within the span.
    took = (upstream_call.end_ns - upstream_call.start_ns) / 1e9
    assert 0 < upstream_call.attributes["gen_ai.response.time_to_first_chunk"] <= took
    assert [name for name, _ in upstream_call.events] == ["gen_ai.first_chunk"]
    assert upstream_call.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert upstream_call.attributes["gen_ai.usage.output_tokens"] > 0
    assert upstream_call.attributes["gen_ai.response.model"] == "gpt-4o-mini"
    # It ends when the stream does, inside the request's span.
    assert server.start_ns <= upstream_call.start_ns <= upstream_call.end_ns <= server.end_ns
    assert upstream.history[-1].headers["traceparent"] == f"00-{CLIENT_TRACE}-{upstream_call.span_id}-01"


def test_a_long_streams_span_reads_its_first_and_last_events(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    # 400 events of about 200 bytes: past the first 8 KB kept and the last chunks kept, so
    # the model comes from the first event and usage and the finish reason from the last.
    events = chat_chunks("word " * 8000, model="gpt-4o-2024", split=400, include_usage=True,
                         finish_reason="length")
    upstream.enqueue(SSEReply(events, delay=0.001))  # chunks of their own, mostly
    proxy = start_proxy()
    stream = chat_client(proxy, CLIENT_HEADERS).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "a long one"}], stream=True)
    assert len("".join(c.choices[0].delta.content or "" for c in stream if c.choices)) == 40000
    call = collector.wait_for(lambda s: s.kind == "CLIENT" and s.trace_id == CLIENT_TRACE)[0]
    assert call.attributes["gen_ai.response.model"] == "gpt-4o-2024"
    assert call.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert call.attributes["gen_ai.usage.output_tokens"] == events[-1]["usage"]["completion_tokens"]


def test_responses_and_messages_requests_get_genai_spans_of_their_format(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, anthropic_base_url=upstream.base_url.removesuffix("/v1"))
    reply = chat_client(proxy).responses.create(model="gpt-4o-mini", input="Hello there")
    assert reply.output_text.startswith("echo: ")
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0)
    with claude.messages.stream(model="claude-scripted-1", max_tokens=64,
                                messages=[{"role": "user", "content": "Hi Claude"}]) as stream:
        assert "".join(stream.text_stream).startswith("echo: ")

    responses = server_span(collector, "/v1/responses")
    call = collector.wait_for(lambda s: s.kind == "CLIENT" and s.parent_id == responses.span_id)[0]
    assert call.attributes["gen_ai.provider.name"] == "openai"
    assert call.attributes["gen_ai.response.finish_reasons"] == ["completed"]
    assert call.attributes["gen_ai.usage.input_tokens"] > 0
    assert call.attributes["gen_ai.response.id"].startswith("resp")
    assert "memproxy.recall" in children(trace_of(collector, responses.trace_id), responses)

    messages = server_span(collector, "/v1/messages")
    call = collector.wait_for(lambda s: s.kind == "CLIENT" and s.parent_id == messages.span_id)[0]
    assert call.name == "chat claude-scripted-1"
    assert call.attributes["gen_ai.provider.name"] == "anthropic"
    assert call.attributes["gen_ai.request.max_tokens"] == 64
    assert call.attributes["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert call.attributes["gen_ai.usage.output_tokens"] > 0
    assert call.attributes["gen_ai.response.time_to_first_chunk"] > 0


def test_learning_jobs_link_to_the_request_that_queued_them(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, extract_every=1, summary_every=1)
    chat_client(proxy, CLIENT_HEADERS).chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": "I moved to Lisbon last spring."}])
    wait_for_jobs(proxy)

    reply = collector.wait_for(lambda s: s.name == "memproxy.remember.reply" and s.trace_id == CLIENT_TRACE)[0]
    def queued_here(kind: str) -> Callable[[ReceivedSpan], bool]:
        return lambda s: s.name == f"memproxy.job {kind}" and any(t == CLIENT_TRACE for t, _ in s.links)

    for kind in ("extract_facts", "summarize", "index"):
        job = collector.wait_for(queued_here(kind))[0]
        assert job.parent_id == "" and job.kind == "CONSUMER"
        assert job.attributes["memproxy.job.kind"] == kind
        if kind != "index":  # queued with the reply, in its transaction
            assert (CLIENT_TRACE, reply.span_id) in job.links


def test_message_contents_are_captured_only_when_asked_and_then_redacted(
    collector: OtlpReceiver, monkeypatch: pytest.MonkeyPatch,
    start_proxy: Callable[..., RunningProxy],
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    proxy = start_proxy()
    client = chat_client(proxy)
    client.chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": f"my key is {SECRET}"}])
    stream = client.chat.completions.create(model="gpt-4o-mini", stream=True, messages=[
        {"role": "user", "content": f"again {SECRET}"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    calls = collector.wait_for(lambda s: s.kind == "CLIENT", count=2)
    for call in calls:
        sent = json.loads(call.attributes["gen_ai.input.messages"])
        said = json.loads(call.attributes["gen_ai.output.messages"])
        assert sent[-1]["role"] == "user" and "[REDACTED:" in sent[-1]["parts"][0]["content"]
        assert said[0]["role"] == "assistant" and said[0]["parts"][0]["content"].startswith("echo: ")
        assert "[REDACTED:" in said[0]["parts"][0]["content"]  # the echo carried the key
    assert not [s for s in collector.spans if SECRET in json.dumps(s.attributes)]


def test_request_log_lines_carry_the_trace(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy],
    capfd: pytest.CaptureFixture[str],
) -> None:
    proxy = start_proxy(log_level="info", log_format="json")
    chat_client(proxy, CLIENT_HEADERS).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}])
    server = server_span(collector, "/v1/chat/completions", CLIENT_TRACE)
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    request = [line for line in lines if line.get("logger") == "memproxy.chat"]
    assert len(request) == 1
    assert (request[0]["trace_id"], request[0]["span_id"]) == (CLIENT_TRACE, server.span_id)
    assert request[0]["status"] == 200


def test_text_log_lines_for_a_terminal(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy],
    capfd: pytest.CaptureFixture[str],
) -> None:
    proxy = start_proxy(log_level="info", log_format="text")
    chat_client(proxy, CLIENT_HEADERS).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}])
    server = server_span(collector, "/v1/chat/completions", CLIENT_TRACE)
    lines = [line for line in capfd.readouterr().err.splitlines() if " memproxy.chat chat " in line]
    assert len(lines) == 1
    assert f"trace_id={CLIENT_TRACE}" in lines[0] and f"span_id={server.span_id}" in lines[0]


@pytest.mark.process
def test_tracing_off_exports_nothing_and_forwards_the_clients_trace_untouched(tmp_path: Path) -> None:
    script = """
import sys
import httpx
from starlette.testclient import TestClient
from config import load_settings
from proxy.app import create_app
from tests.support.scripted_upstream import ScriptedUpstream

with ScriptedUpstream() as up:
    settings = load_settings(env={"MEMPROXY_UPSTREAM_BASE_URL": up.base_url,
                                  "MEMPROXY_DATA_DIR": sys.argv[1]})
    with TestClient(create_app(settings, with_memory=False), base_url="http://127.0.0.1") as client:
        reply = client.post("/v1/chat/completions", headers={"traceparent": sys.argv[2]},
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
    print(up.history[-1].headers.get("traceparent"))
    # Chroma imports the SDK and its gRPC exporter itself (its own telemetry); memproxy makes
    # no provider and imports no exporter.
    from opentelemetry import trace
    print(type(trace.get_tracer_provider()).__name__,
          sorted(m for m in sys.modules if m.startswith("opentelemetry.exporter.otlp.proto.http")))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), CLIENT_HEADERS["traceparent"]],
        cwd=ROOT, env={**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, capture_output=True,
        text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    forwarded, imported = done.stdout.strip().splitlines()[-2:]
    # Not a participant in the trace: the header goes on as any other, as before tracing.
    assert forwarded == CLIENT_HEADERS["traceparent"]
    assert imported == "ProxyTracerProvider []"


def test_refused_requests_are_traced_too(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(api_keys="sk-memproxy-right")
    reply = httpx.post(f"{proxy.base_url}/chat/completions", headers=CLIENT_HEADERS,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 401
    server = server_span(collector, "/v1/chat/completions", CLIENT_TRACE)
    assert server.attributes["http.response.status_code"] == 401
    assert server.status == 0  # a 4xx is the client's error, not the server's (HTTP semconv)


def test_a_request_sampled_out_exports_nothing_and_still_propagates(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    with OtlpReceiver() as receiver:
        with collecting(receiver.endpoint, TraceIdRatioBased(0)):
            proxy = start_proxy(memory=True)
            client = chat_client(proxy, CLIENT_HEADERS)
            reply = client.chat.completions.create(model="gpt-4o-mini", messages=[
                {"role": "user", "content": "hello"}])
            assert reply.choices[0].message.content == "echo: hello"
            wait_for_jobs(proxy)
            sent = upstream.history[-1].headers["traceparent"].split("-")
            # The client's trace goes on, not sampled, through a span id of memproxy's own.
            assert (sent[1], sent[3]) == (CLIENT_TRACE, "00") and sent[2] != CLIENT_SPAN
            proxy.stop()
        assert receiver.spans == []  # flushed as the block ended


def test_health_probes_make_no_span(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy()
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{proxy.url}{path}", headers=CLIENT_HEADERS).status_code == 200
    assert httpx.get(f"{proxy.base_url}/models", headers=CLIENT_HEADERS).status_code == 200
    server = server_span(collector, "/v1/{path:path}", CLIENT_TRACE)  # the probes' came first
    assert [s.attributes["url.path"] for s in collector.spans] == [server.attributes["url.path"]]


def test_a_route_through_litellm_carries_memproxys_span_upstream(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    origin = upstream.base_url.removesuffix("/v1")
    proxy = start_proxy(routes=(
        Route("claude-*", base_url=origin, api_key="sk-ant-route", provider="anthropic"),
    ))
    completion = chat_client(proxy, CLIENT_HEADERS).chat.completions.create(
        model="claude-test", max_tokens=50, messages=[{"role": "user", "content": "Hi"}])
    assert completion.choices[0].message.content
    call = collector.wait_for(lambda s: s.kind == "CLIENT" and s.trace_id == CLIENT_TRACE)[0]
    assert call.attributes["gen_ai.provider.name"] == "anthropic"
    assert call.attributes["gen_ai.usage.input_tokens"] > 0
    sent = upstream.history[-1]
    assert sent.path == "/v1/messages"  # translated by litellm
    assert sent.headers["traceparent"] == f"00-{CLIENT_TRACE}-{call.span_id}-01"


def test_memory_tool_rounds_are_spans_of_the_request(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, memory_tool_prefetch=0)
    note = json.dumps({"type": "turn", "session_id": "old", "role": "user",
                       "content": "The billing service runs on Postgres 16."})
    assert httpx.post(f"{proxy.url}/v1/memory/import", content=note, timeout=60).status_code == 200
    wait_for_jobs(proxy)
    search = {"name": "memory_search", "arguments": {"query": "billing service database"}}
    upstream.enqueue(JSONReply(chat_completion(None, tool_calls=[search])),
                     JSONReply(chat_completion("Postgres 16.")))
    reply = chat_client(proxy, {**CLIENT_HEADERS, "X-Memory-Mode": "tool"}).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "Which database does billing use?"}])
    assert reply.choices[0].message.content == "Postgres 16."

    server = server_span(collector, "/v1/chat/completions", CLIENT_TRACE)
    collector.wait_for(lambda s: s.name == "memproxy.remember.reply" and s.trace_id == CLIENT_TRACE)
    spans = trace_of(collector, CLIENT_TRACE)
    rounds = [s for s in spans if s.kind == "CLIENT" and s.parent_id == server.span_id]
    assert len(rounds) == 2  # one CLIENT span per round with the model
    assert rounds[0].attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
    searched = one(spans, "memproxy.memory_tool.search", parent_id=server.span_id)
    recall = one(spans, "memproxy.recall", parent_id=searched.span_id)
    assert recall.attributes["memproxy.recall.items"] >= 1
    # The search ran between the two rounds.
    assert rounds[0].end_ns <= searched.start_ns <= searched.end_ns <= rounds[1].start_ns
