"""Every failure path: OpenAI's envelope, the right status, the SDK's matching exception."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningProxy
from tests.support.scripted_upstream import (
    Drop,
    ErrorReply,
    Hang,
    RawReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
)

MESSAGES = [{"role": "user", "content": "hello"}]


def assert_envelope(response: httpx.Response, status: int, *, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m", "messages": "hello"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 7}]}', "messages[0].content"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": true}', "n"),
    ],
)
def test_bad_bodies_are_400(client: httpx.Client, upstream: ScriptedUpstream, body: bytes, param: str | None) -> None:
    response = client.post("/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"})
    error = assert_envelope(response, 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert upstream.history == []


def test_sdk_raises_bad_request(proxy: RunningProxy) -> None:
    client = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc, list-item]


def test_body_over_the_limit_is_413(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(max_body_bytes=1000)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
    assert_envelope(httpx.post(f"{proxy.base_url}/chat/completions", json=big), 413)
    assert_envelope(httpx.post(f"{proxy.base_url}/files", content=b"x" * 5000), 413)


def test_unknown_route_and_method_use_the_envelope(client: httpx.Client) -> None:
    assert_envelope(client.get("/nowhere"), 404)
    assert_envelope(client.post("/healthz"), 405)


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def test_unreachable_upstream_is_502(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(upstream_base_url=f"http://127.0.0.1:{closed_port()}/v1")
    response = httpx.post(f"{proxy.base_url}/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert assert_envelope(response, 502)["code"] == "upstream_unreachable"
    client = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.models.list()
    assert caught.value.status_code == 502


def test_upstream_dropping_the_connection_is_502(client: httpx.Client, upstream: ScriptedUpstream) -> None:
    upstream.enqueue(Drop())
    assert_envelope(client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}), 502)


def test_a_pooled_connection_the_upstream_closed_is_sent_again_once(
    client: httpx.Client, upstream: ScriptedUpstream
) -> None:
    """What an upstream that closed an idle keep-alive connection looks like: the request
    written to the pooled connection gets no answer. It goes again on a new connection."""
    body = {"model": "m", "messages": MESSAGES}
    assert client.post("/v1/chat/completions", json=body).status_code == 200  # pools a connection
    upstream.enqueue(Drop())
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert len(upstream.history) == 3
    # Twice in a row is an upstream that drops requests, not a stale connection: 502.
    upstream.enqueue(Drop(), Drop())
    assert_envelope(client.post("/v1/chat/completions", json=body), 502)
    assert len(upstream.history) == 5


def test_upstream_timeout_is_504(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> None:
    proxy = start_proxy(upstream_timeout=0.3)
    upstream.enqueue(Hang(20))
    started = time.monotonic()
    response = httpx.post(f"{proxy.base_url}/chat/completions", json={"model": "m", "messages": MESSAGES},
                          timeout=30)
    assert assert_envelope(response, 504)["code"] == "upstream_timeout"
    assert time.monotonic() - started < 10  # the proxy gave up long before the upstream answered


@pytest.mark.parametrize(
    ("status", "exception"),
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (403, openai.PermissionDeniedError),
        (404, openai.NotFoundError),
        (429, openai.RateLimitError),
        (500, openai.InternalServerError),
        (503, openai.InternalServerError),
    ],
)
def test_upstream_errors_keep_status_and_body(
    proxy: RunningProxy, upstream: ScriptedUpstream, status: int, exception: type[Exception]
) -> None:
    upstream.enqueue(ErrorReply(status, f"upstream says {status}", headers={"retry-after": "7"}))
    client = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0)
    with pytest.raises(exception) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    error: Any = caught.value
    assert error.status_code == status
    assert error.body["message"] == f"upstream says {status}"
    assert error.response.headers["retry-after"] == "7"


def test_non_json_upstream_error_is_wrapped(client: httpx.Client, upstream: ScriptedUpstream) -> None:
    upstream.enqueue(RawReply(b"<html>bad gateway</html>", status=502, content_type="text/html"))
    error = assert_envelope(client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}), 502)
    assert "bad gateway" in error["message"]


def test_failure_after_the_stream_started_is_one_error_event(
    proxy: RunningProxy, upstream: ScriptedUpstream, client: httpx.Client
) -> None:
    upstream.enqueue(SSEReply(chat_chunks("one two three four", split=4), cut_after=3))
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "m", "messages": MESSAGES, "stream": True}) as response:
        assert response.status_code == 200
        body = b"".join(response.iter_raw())
    assert body.count(b"event: error") == 1
    assert body.rstrip().endswith(b"}")  # the error event is last; no [DONE]
    assert b"[DONE]" not in body
    upstream.enqueue(SSEReply(chat_chunks("one two three four", split=4), cut_after=3))
    sdk = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True):  # type: ignore[arg-type]
            pass


def test_client_disconnect_cancels_the_upstream_stream(
    proxy: RunningProxy, upstream: ScriptedUpstream, client: httpx.Client
) -> None:
    upstream.enqueue(SSEReply(chat_chunks("x " * 200, split=200), delay=0.05))
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "m", "messages": MESSAGES, "stream": True}) as response:
        first = next(response.iter_raw())
        assert first
    metrics = proxy.state.metrics
    deadline = time.monotonic() + 5
    while metrics.inflight_streams._value.get() != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics.inflight_streams._value.get() == 0
    deadline = time.monotonic() + 5
    while not upstream.abandoned_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert upstream.abandoned_streams == 1  # the upstream saw its client go away early
