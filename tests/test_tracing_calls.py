"""Traces of memproxy's own calls (docs/tracing.md): compaction, learning calls and upstream
embeddings, each a CLIENT span whose `traceparent` the upstream gets; and OTEL_PROPAGATORS,
which decides whether memproxy reads and writes W3C Trace Context at all."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import httpx
import pytest
from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from config import Route
from proxy.upstream.genai_span import reply_attributes
from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.scripted_upstream import Received, ScriptedUpstream
from tests.support.tracing import collecting
from tests.test_compaction import long_chat, summariser
from tests.test_tracing import CLIENT_HEADERS, CLIENT_SPAN, CLIENT_TRACE, chat_client


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    with OtlpReceiver() as receiver, collecting(receiver.endpoint):
        yield receiver


@contextlib.contextmanager
def propagating(*propagators: TextMapPropagator) -> Iterator[None]:
    """The propagators an outer program configured (as OTEL_PROPAGATORS does), for a while."""
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator(list(propagators)))
    try:
        yield
    finally:
        propagate.set_global_textmap(before)


def carried(request: Received, span: ReceivedSpan) -> bool:
    """Whether the upstream request carries `span` as its parent."""
    return request.headers.get("traceparent", "").split("-")[1:3] == [span.trace_id, span.span_id]


def test_compaction_is_a_span_with_its_summary_call_under_it(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(
        memory=True, compact_keep_last=4, memory_read=False,
        routes=(Route("small-*", base_url=upstream.base_url, context_window=2000),),
    )
    asked = summariser(upstream)
    reply = httpx.post(f"{proxy.base_url}/chat/completions", timeout=30, json={
        "model": "small-model", "messages": long_chat()},
        headers={**CLIENT_HEADERS, "X-Memory-User-Id": "ada", "X-Memory-Compact": "on"})
    assert reply.status_code == 200, reply.text
    before, after = map(int, reply.headers["x-memory-compacted"].split("->"))

    compaction = collector.wait_for(lambda s: s.name == "memproxy.compaction")[0]
    server = collector.wait_for(lambda s: s.kind == "SERVER" and s.trace_id == CLIENT_TRACE)[0]
    assert compaction.parent_id == server.span_id
    assert compaction.attributes["memproxy.compaction.window"] == 2000
    assert compaction.attributes["memproxy.compaction.tokens_before"] == before
    assert compaction.attributes["memproxy.compaction.tokens_after"] == after
    # The session's summary was made now, by a learning call: a CLIENT span under compaction.
    summary = collector.wait_for(lambda s: s.kind == "CLIENT" and s.parent_id == compaction.span_id)[0]
    assert summary.attributes["gen_ai.operation.name"] == "chat"
    assert summary.attributes["gen_ai.request.model"] == "small-model"  # the conversation's model
    assert summary.attributes["gen_ai.usage.output_tokens"] > 0
    assert len(asked) == 1 and carried(asked[0], summary)
    assert compaction.start_ns <= summary.start_ns <= summary.end_ns <= compaction.end_ns


def test_a_learning_call_is_a_client_span_of_its_job(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, extract_every=1)
    chat_client(proxy, CLIENT_HEADERS).chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": "I moved to Lisbon last spring."}])
    wait_for_jobs(proxy)

    job = collector.wait_for(lambda s: s.name == "memproxy.job extract_facts")[0]
    call = collector.wait_for(lambda s: s.kind == "CLIENT" and s.parent_id == job.span_id)[0]
    assert call.trace_id == job.trace_id != CLIENT_TRACE  # the job's own trace
    assert call.name == "chat gpt-4o-mini"  # the conversation's model (no extract_model set)
    assert call.attributes["gen_ai.provider.name"] == "openai"
    assert call.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert call.attributes["server.address"] == "127.0.0.1"
    assert [r for r in upstream.history if carried(r, call)]


def test_an_upstream_embedding_call_is_a_client_span(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, embedding_backend="upstream", upstream_api_key="sk-operator")
    client = chat_client(proxy)
    client.chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": "The nightly backup job writes to bucket zeta-archive."}])
    wait_for_jobs(proxy)
    chat_client(proxy, CLIENT_HEADERS).chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": "Which bucket does the nightly backup job write to?"}])

    # The query's embedding, during recall: under the embed_query span of the request.
    embed = collector.wait_for(lambda s: s.name == "memproxy.recall.embed_query"
                               and s.trace_id == CLIENT_TRACE)[0]
    call = collector.wait_for(lambda s: s.kind == "CLIENT" and s.parent_id == embed.span_id)[0]
    assert call.name == "embeddings text-embedding-3-small"
    assert call.attributes["gen_ai.operation.name"] == "embeddings"
    assert call.attributes["gen_ai.request.model"] == "text-embedding-3-small"
    assert call.attributes["gen_ai.usage.input_tokens"] > 0
    sent = [r for r in upstream.history if r.path == "/v1/embeddings" and carried(r, call)]
    assert len(sent) == 1 and sent[0].headers["authorization"] == "Bearer sk-operator"
    # The index job's embeddings: under the job's span.
    job = collector.wait_for(lambda s: s.name == "memproxy.job index")[0]
    assert collector.wait_for(lambda s: s.name.startswith("embeddings ") and s.parent_id == job.span_id)


@pytest.mark.parametrize("propagators", [(), (W3CBaggagePropagator(),)], ids=["none", "baggage"])
def test_without_tracecontext_in_the_propagators_memproxy_takes_no_part_in_the_trace(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    propagators: tuple[TextMapPropagator, ...],
) -> None:
    proxy = start_proxy()
    headers = {**CLIENT_HEADERS, "baggage": "team=search"}
    with propagating(*propagators):
        chat_client(proxy, headers).chat.completions.create(model="gpt-4o-mini", messages=[
            {"role": "user", "content": "hello"}])
        assert httpx.get(f"{proxy.base_url}/models", headers=headers).status_code == 200

    servers = collector.wait_for(lambda s: s.kind == "SERVER", count=2)
    # Traced still, but as traces of memproxy's own: the client's span is no parent.
    assert all(s.parent_id == "" and s.trace_id != CLIENT_TRACE for s in servers)
    # Its headers go upstream as they came, as with tracing off, on both kinds of route.
    for sent in upstream.history[-2:]:
        assert sent.headers["traceparent"] == CLIENT_HEADERS["traceparent"]
        assert sent.headers["tracestate"] == CLIENT_HEADERS["tracestate"]
        assert sent.headers["baggage"] == "team=search"


def test_tracecontext_and_baggage_carry_memproxys_span_and_the_clients_baggage(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy()
    with propagating(TraceContextTextMapPropagator(), W3CBaggagePropagator()):  # the default
        chat_client(proxy, {**CLIENT_HEADERS, "baggage": "team=search"}).chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hello"}])
    server = collector.wait_for(lambda s: s.kind == "SERVER")[0]
    call = collector.wait_for(lambda s: s.kind == "CLIENT")[0]
    assert (server.trace_id, server.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    sent = upstream.history[-1].headers
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{call.span_id}-01"
    assert sent["baggage"] == "team=search"  # carried on once (repeats would be joined)


@pytest.mark.parametrize(("objects", "expected"), [
    pytest.param([{"id": "chatcmpl-1", "model": "gpt-4o-mini", "choices": [{"finish_reason": "length"},
                                                                           {"finish_reason": None}],
                   "usage": {"prompt_tokens": 12, "completion_tokens": True}}],
                 {"gen_ai.usage.input_tokens": 12, "gen_ai.response.model": "gpt-4o-mini",
                  "gen_ai.response.id": "chatcmpl-1", "gen_ai.response.finish_reasons": ["length"]},
                 id="chat: a flag is no count, a null reason no reason"),
    pytest.param([{"type": "response.created", "response": {"id": "resp_1", "model": "gpt-4.1"}},
                  {"type": "response.incomplete", "response": {
                      "object": "response", "status": "incomplete",
                      "incomplete_details": {"reason": "max_output_tokens"},
                      "usage": {"input_tokens": 5, "output_tokens": 9}}}],
                 {"gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 9,
                  "gen_ai.response.model": "gpt-4.1", "gen_ai.response.id": "resp_1",
                  "gen_ai.response.finish_reasons": ["max_output_tokens"]},
                 id="responses stream: the reason an incomplete reply gives"),
    pytest.param([{"type": "message_start", "message": {"id": "msg_1", "model": "claude-x",
                                                         "usage": {"input_tokens": 7, "output_tokens": 1}}},
                  {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                   "usage": {"output_tokens": 30}}],
                 {"gen_ai.usage.input_tokens": 7, "gen_ai.usage.output_tokens": 30,
                  "gen_ai.response.model": "claude-x", "gen_ai.response.id": "msg_1",
                  "gen_ai.response.finish_reasons": ["end_turn"]},
                 id="messages stream: the last usage counts"),
    pytest.param([{"model": 3, "id": ["x"], "usage": "many", "choices": "none"}], {},
                 id="nothing of the right type"),
])
def test_a_replys_genai_attributes_in_each_api_format(objects: list[dict[str, object]],
                                                       expected: dict[str, object]) -> None:
    assert reply_attributes(objects) == expected
