"""Trace Context from clients (docs/security.md, "Traces"): whatever a client sends as
`traceparent`/`tracestate` only parents memproxy's span when valid, never reaches the
upstream as sent while tracing is on, and no span carries a key, a user id or message text."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.tracing import collecting

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
MALFORMED = [
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # an all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",  # an all-zero span id
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case is invalid
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
    "hello",
    "00-" + "a" * 8000,
]
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    with OtlpReceiver() as receiver, collecting(receiver.endpoint):
        yield receiver


@pytest.mark.parametrize("sent", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_traceparent_starts_a_trace_of_its_own_and_stays_here(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    sent: str,
) -> None:
    proxy = start_proxy()
    reply = httpx.post(f"{proxy.base_url}/chat/completions", json=BODY,
                       headers={"traceparent": sent, "tracestate": "app=1"})
    assert reply.status_code == 200
    server = collector.wait_for(lambda s: s.kind == "SERVER")[0]
    assert server.parent_id == ""  # a root: the client's header was not a valid parent
    call = collector.wait_for(lambda s: s.kind == "CLIENT")[0]
    headers = upstream.history[-1].headers
    # Sampled; with the W3C level 2 "random trace id" flag, as the SDK starts a trace.
    assert headers["traceparent"] == f"00-{server.trace_id}-{call.span_id}-03"
    assert "tracestate" not in headers  # read only with a valid traceparent (W3C 3.3)


def test_two_traceparents_are_none(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy()
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    with httpx.Client() as client:
        reply = client.post(f"{proxy.base_url}/chat/completions", json=BODY,
                            headers=[("traceparent", VALID), ("traceparent", other)])
    assert reply.status_code == 200
    server = collector.wait_for(lambda s: s.kind == "SERVER")[0]
    assert server.parent_id == "" and server.trace_id not in VALID + other
    assert upstream.history[-1].headers["traceparent"].split("-")[1] == server.trace_id


def test_an_oversized_or_malformed_tracestate_is_not_forwarded(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy()
    for state in (",".join(f"k{i}=v" for i in range(40)), "a=b,@@@=c", "x=" + "y" * 600):
        reply = httpx.post(f"{proxy.base_url}/chat/completions", json=BODY,
                           headers={"traceparent": VALID, "tracestate": state})
        assert reply.status_code == 200
        assert upstream.history[-1].headers.get("tracestate") != state
        assert upstream.history[-1].headers["traceparent"].split("-")[1] == VALID.split("-")[1]


def test_no_span_carries_a_key_a_user_id_or_message_text(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    key = "sk-memproxy-tracing-key-0123456789"
    proxy = start_proxy(memory=True, api_keys=key)
    secret_text = "the vault code is 5821-red-otter"
    for stream in (False, True):
        reply = httpx.post(
            f"{proxy.base_url}/chat/completions", json={**BODY, "stream": stream, "messages": [
                {"role": "user", "content": secret_text}]},
            headers={"authorization": f"Bearer {key}", "x-memory-user-id": "user-4711",
                     "traceparent": VALID}, timeout=30)
        assert reply.status_code == 200
    collector.wait_for(lambda s: s.name == "memproxy.remember.reply", count=2)
    collector.wait_for(lambda s: s.name.startswith("memproxy.job "))
    dumped = json.dumps([(s.name, s.attributes, s.events) for s in collector.spans])
    for leaked in (key, "user-4711", "5821-red-otter", "echo:"):
        assert leaked not in dumped


def test_a_pass_through_request_carries_memproxys_span_not_the_clients(
    collector: OtlpReceiver, start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy()
    reply = httpx.get(f"{proxy.base_url}/models", headers={"traceparent": VALID})
    assert reply.status_code == 200
    server = collector.wait_for(lambda s: s.kind == "SERVER")[0]
    assert server.attributes["http.route"] == "/v1/{path:path}"
    trace_id = VALID.split("-")[1]
    assert server.trace_id == trace_id
    assert upstream.history[-1].headers["traceparent"] == f"00-{trace_id}-{server.span_id}-01"
