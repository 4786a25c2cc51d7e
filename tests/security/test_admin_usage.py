"""Attacks on usage (docs/usage.md, docs/security.md): odd stream_options, usage stripping
that must never eat real content, usage events split at awkward bytes, the admin API's
query parameters, and quota evasion through other ways in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from schemathesis import Case
from schemathesis.specs.openapi.checks import positive_data_acceptance

from config import load_settings
from memory.index.embeddings import LocalEmbedder
from proxy.formats.chat import CHAT
from proxy.formats.messages import MESSAGES as MESSAGES_FORMAT
from proxy.formats.usage import MAX_HELD, chat_usage
from proxy.management.openapi import DOCUMENT
from tests.conftest import MODEL_DIR, RunningProxy, serve
from tests.support.formats import message_events
from tests.support.scripted_upstream import (
    JSONReply,
    RawReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)

Starter = Callable[..., RunningProxy]
ADMIN = "admin-key-usage-02"
KEY = "key-mallory-00001"
SPENT = "key-spent-0000002"
KEYS = f"{KEY}:mallory,{SPENT}:sam:quota=0"
MESSAGES: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture
def served(start_proxy: Starter) -> RunningProxy:
    return start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN)


def raw_stream(proxy: RunningProxy, body: dict[str, Any]) -> bytes:
    with httpx.Client(base_url=proxy.url, timeout=20) as http:
        response = http.post("/v1/chat/completions", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return response.content


def events(stream: bytes) -> list[dict[str, Any]]:
    found = []
    for block in stream.split(b"\n\n"):
        data = block.removeprefix(b"data: ")
        if data and data != b"[DONE]":
            found.append(orjson.loads(data))
    return found


def mallory(proxy: RunningProxy) -> dict[str, Any]:
    with httpx.Client(base_url=proxy.url, timeout=20) as http:
        report = http.get("/v1/admin/usage", params={"user": "mallory"},
                          headers={"Authorization": f"Bearer {ADMIN}"}).json()
    rows: list[dict[str, Any]] = report["data"]
    assert len(rows) == 1
    return rows[0]


def test_include_usage_false_is_asked_for_and_stripped(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    body = {"model": "m", "messages": MESSAGES,
            "stream_options": {"include_usage": False, "include_obfuscation": False}}
    got = events(raw_stream(served, body))
    sent = upstream.history[-1].json["stream_options"]
    assert sent == {"include_usage": True, "include_obfuscation": False}  # theirs kept
    # No chunk without choices, no counts: OpenAI's `"usage": null` on each chunk stays.
    assert got and all(e["choices"] for e in got) and all(e.get("usage") is None for e in got)
    assert mallory(served)["input_tokens"] > 0


@pytest.mark.parametrize("odd", ["yes", 1, None])
def test_an_include_usage_that_is_not_a_boolean_goes_as_sent(
    served: RunningProxy, upstream: ScriptedUpstream, odd: Any
) -> None:
    body = {"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": odd}}
    raw_stream(served, body)
    sent = upstream.history[-1].json["stream_options"]
    # None (JSON null) is "not asked", like false; anything else is the upstream's to judge.
    assert sent == ({"include_usage": True} if odd is None else {"include_usage": odd})


def test_stripping_never_eats_content_that_looks_like_usage(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    bait = 'see ,"usage":null and "usage":{"prompt_tokens":999} here'
    chunks = chat_chunks(bait, include_usage=True, prompt_tokens=12)
    # A provider that puts usage on the finish chunk, next to real choices.
    finish = {**chunks[-2], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}
    upstream.enqueue(SSEReply([*chunks[:-2], finish]))
    got = events(raw_stream(served, {"model": "m", "messages": MESSAGES}))
    text = "".join(c["delta"].get("content") or "" for e in got for c in e["choices"])
    assert text == bait
    assert got[-1]["choices"][0]["finish_reason"] == "stop"  # the finish chunk is kept
    counted = mallory(served)
    assert (counted["input_tokens"], counted["output_tokens"]) == (5, 6)


@pytest.mark.parametrize("size", [1, 7, 64])
def test_usage_chunks_split_at_any_byte_are_stripped_and_counted(
    served: RunningProxy, upstream: ScriptedUpstream, size: int
) -> None:
    payload = b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n"
                       for e in chat_chunks("split me", include_usage=True, prompt_tokens=21))
    upstream.enqueue(RawReply(payload + b"data: [DONE]\r\n\r\n", content_type="text/event-stream",
                              chunk_size=size))
    with openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0) as client:
        got = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert all(chunk.choices and chunk.usage is None for chunk in got)
    assert "".join(c.choices[0].delta.content or "" for c in got) == "split me"
    assert mallory(served)["input_tokens"] == 21


def test_the_tap_at_every_split_point() -> None:
    """Every way of cutting a stream in two gives the same bytes and counts."""
    stream = b"".join(b"data: " + orjson.dumps(e) + b"\n\n"
                      for e in chat_chunks("abc", include_usage=True, prompt_tokens=9, split=1))
    whole = CHAT.usage_tap(strip=True)
    expected = whole.feed(stream) + whole.end()
    assert b'"usage":{' not in expected and b'"content":"abc"' in expected
    assert expected.count(b"\n\n") == stream.count(b"\n\n") - 1  # one chunk out, no more
    for cut in range(1, len(stream)):
        tap = CHAT.usage_tap(strip=True)
        out = tap.feed(stream[:cut]) + tap.feed(stream[cut:]) + tap.end()
        assert out == expected, cut
        assert (tap.input_tokens, tap.output_tokens) == (whole.input_tokens, whole.output_tokens)
    reading = MESSAGES_FORMAT.usage_tap(strip=False)  # the bytes go through as they came
    messages = b"".join(message_events("hi", input_tokens=33))
    assert reading.feed(messages) + reading.end() == messages and reading.input_tokens == 33


def test_the_tap_reads_events_ended_by_any_blank_line() -> None:
    """A blank line may be any two line ends (WHATWG): LF then CRLF ends each event here, and
    the usage chunk is still read, taken out, and the other events pass as they came."""
    events = [b"data: " + orjson.dumps(e) + b"\n\r\n"
              for e in chat_chunks("abc", include_usage=True, prompt_tokens=9, split=1)]
    tap = CHAT.usage_tap(strip=True)
    out = b"".join(tap.feed(event) for event in events) + tap.end()
    assert (tap.input_tokens, tap.output_tokens) == (9, 1)
    assert out == b"".join(e for e in events if b'"usage":{' not in e)


def test_a_stream_without_event_ends_is_not_held_without_bound() -> None:
    tap = CHAT.usage_tap(strip=True)
    out = tap.feed(b"x" * (MAX_HELD + 1))
    assert len(out) == MAX_HELD + 1  # past the bound the bytes go through unread


def test_usage_figures_from_the_upstream_are_checked() -> None:
    for bad in (-5, True, "12", 1.5, 10**13):
        seen = chat_usage({"choices": [], "usage": {"prompt_tokens": bad, "completion_tokens": 1}})
        assert seen is not None and seen.input_tokens is None and seen.output_tokens == 1


def test_admin_usage_parameters_cannot_reach_sql_or_other_keys(served: RunningProxy) -> None:
    with httpx.Client(base_url=served.url, timeout=20) as http:
        http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                  headers={"Authorization": f"Bearer {KEY}"})
        admin = {"Authorization": f"Bearer {ADMIN}"}
        injected = http.get("/v1/admin/usage", params={"key_id": "' OR '1'='1"}, headers=admin)
        assert injected.status_code == 200 and injected.json()["data"] == []
        assert injected.json()["totals"]["requests"] == 0
        twice = http.get("/v1/admin/usage?user=a&user=b", headers=admin)
        assert twice.status_code == 400 and twice.json()["error"]["param"] == "user"
        control = http.get("/v1/admin/usage", params={"user": "a\x00b"}, headers=admin)
        assert control.status_code == 400
        # A user's own key reads no usage, its own included.
        own = http.get("/v1/admin/usage", params={"user": "mallory"},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert own.status_code == 403 and "input_tokens" not in own.text
        # Another method is refused here, not relayed upstream by the pass-through.
        for method in ("POST", "DELETE"):
            other = http.request(method, "/v1/admin/usage", headers={"Authorization": f"Bearer {KEY}"})
            assert other.status_code == 405 and other.headers["allow"] == "GET, HEAD"


def test_a_spent_key_gets_through_no_other_way(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    """quota=0: spent from the start; neither another user id, nor a stream, nor the
    pass-through, nor memory off lets a request reach the upstream."""
    upstream.enqueue(JSONReply(chat_completion("never")))
    with httpx.Client(base_url=served.url, timeout=20) as http:
        auth = {"Authorization": f"Bearer {SPENT}"}
        for path, body, headers in [
            ("/v1/chat/completions", {"model": "m", "messages": MESSAGES}, {"X-Memory-User-Id": "other"}),
            ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True}, {}),
            ("/v1/chat/completions", {"model": "m", "messages": MESSAGES}, {"X-Memory": "off"}),
            ("/v1/responses", {"model": "m", "input": "x"}, {}),
            ("/v1/embeddings", {"model": "e", "input": "x"}, {}),
        ]:
            refused = http.post(path, json=body, headers={**auth, **headers})
            assert refused.status_code == 429, (path, refused.text)
            assert refused.json()["error"]["code"] == "token_quota_exceeded"
    assert upstream.history == []


@pytest.fixture(scope="module")
def fuzzed(embedder: LocalEmbedder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProxy]:
    with ScriptedUpstream(keep_history=False) as upstream:
        running = serve(load_settings(env={
            "MEMPROXY_UPSTREAM_BASE_URL": upstream.base_url,
            "MEMPROXY_DATA_DIR": str(tmp_path_factory.mktemp("fuzz-usage")),
            "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR), "MEMPROXY_LOG_LEVEL": "error",
            "MEMPROXY_MEMORY": "off", "MEMPROXY_API_KEYS": KEYS, "MEMPROXY_ADMIN_KEY": ADMIN,
        }), with_memory=True, embedder=embedder)
        try:
            httpx.post(f"{running.base_url}/chat/completions", timeout=20,
                       json={"model": "m", "messages": MESSAGES},
                       headers={"Authorization": f"Bearer {KEY}"})
            yield running
        finally:
            running.stop()


admin_schema = schemathesis.openapi.from_dict(DOCUMENT).include(
    path=[path for path, item in DOCUMENT["paths"].items() if "servers" in item])


@pytest.mark.fuzz
@admin_schema.parametrize()
@hypothesis_settings(max_examples=25, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))
def test_the_admin_usage_api_conforms_to_its_document(case: Case[Any], fuzzed: RunningProxy) -> None:
    """Every answer, to any parameters, is one the document describes (400s included). A
    schema-valid request may still be a 400: from after to, or 2026-02-30, are beyond what
    the schema says."""
    case.call_and_validate(base_url=f"{fuzzed.url}/v1/admin", timeout=30,
                           headers={"Authorization": f"Bearer {ADMIN}"},
                           excluded_checks=[positive_data_acceptance])
