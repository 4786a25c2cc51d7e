"""Per-key limits: request rate (token bucket) and open streams, through a real server.

Clients are the official SDK (max_retries=0, so a 429 surfaces as RateLimitError) and httpx;
the upstream is the scripted one. The bucket's arithmetic is also checked with hypothesis
against an injected clock.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam

from config import ApiKey
from proxy.access.limits import KeyLimits, limit_key
from proxy.http.errors import RateLimited
from tests.conftest import RunningProxy
from tests.support.scripted_upstream import ErrorReply, ScriptedUpstream, SSEReply, chat_chunks

Starter = Callable[..., RunningProxy]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def sdk(proxy: RunningProxy, key: str = "sk-client-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0, timeout=20)


def ask(proxy: RunningProxy, key: str = "sk-client-a") -> None:
    with sdk(proxy, key) as client:
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)


def refused(proxy: RunningProxy, key: str = "sk-client-a", *, stream: bool = False) -> openai.RateLimitError:
    with sdk(proxy, key) as client, pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, stream=stream
        )
    return caught.value


def assert_envelope(error: openai.RateLimitError, code: str) -> int:
    """OpenAI's envelope with this code; returns Retry-After in seconds."""
    assert error.status_code == 429
    body = error.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == code
    assert body["error"]["message"]
    retry_after = error.response.headers["retry-after"]
    assert retry_after.isdigit(), retry_after  # whole seconds (RFC 9110 10.2.3)
    return int(retry_after)


def wait_streams(proxy: RunningProxy, key: str, count: int, timeout: float = 5.0) -> float:
    """Wait until `key` has `count` open streams; returns the seconds it took."""
    started = time.monotonic()
    hashed = limit_key(None, {"authorization": f"Bearer {key}"}, "default")
    while proxy.state.limits.open_streams(hashed) != count:
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{proxy.state.limits.open_streams(hashed)} streams open, not {count}")
        time.sleep(0.02)
    return time.monotonic() - started


# -- request rate ------------------------------------------------------------------------


def test_rate_off_by_default_streams_capped(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    assert proxy.state.limits.rate == 0 and proxy.state.limits.max_streams == 64
    with sdk(proxy) as client:
        for _ in range(25):
            client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert len(upstream.history) == 25


def test_rate_limit_429_with_a_truthful_retry_after(
    start_proxy: Starter, upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(rate_limit=30, rate_limit_burst=2)  # one request per 2 s
    started = time.monotonic()
    ask(proxy)
    ask(proxy)
    wait = assert_envelope(refused(proxy), "rate_limit_exceeded")
    # The bucket refilled for as long as the three requests took (seconds on a busy machine).
    assert max(1, math.floor(2 - (time.monotonic() - started))) <= wait <= 2
    assert len(upstream.history) == 2  # the refused request never reached the upstream
    # A refusal takes nothing from the bucket: once the advertised time has passed, the
    # next request goes through.
    time.sleep(wait)
    ask(proxy)
    assert len(upstream.history) == 3


def test_retry_after_is_the_refill_time_of_a_slow_bucket(start_proxy: Starter) -> None:
    proxy = start_proxy(rate_limit=6)  # one request per 10 s; the bucket holds 6
    started = time.monotonic()
    with sdk(proxy) as client:
        for _ in range(6):
            client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    wait = assert_envelope(refused(proxy), "rate_limit_exceeded")
    assert max(1, math.floor(10 - (time.monotonic() - started))) <= wait <= 10


def test_without_proxy_keys_the_address_counts_too(start_proxy: Starter) -> None:
    proxy = start_proxy(rate_limit=1)  # one a minute: nothing refills during the test
    ask(proxy, "sk-client-a")
    refused(proxy, "sk-client-a")
    # Nothing checks a bring-your-own key: another string from the same address is refused
    # too (it was a fresh bucket, so rotating strings got around the limit).
    refused(proxy, "sk-client-b")
    with httpx.Client(base_url=proxy.base_url, timeout=20) as http:
        body = {"model": "gpt-4o-mini", "messages": MESSAGES}
        again = http.post("/chat/completions", json={**body, "user": "ann"})
        assert again.status_code == 429 and 50 <= int(again.headers["retry-after"]) <= 60
        assert again.json()["error"]["code"] == "rate_limit_exceeded"


def test_proxy_keys_are_the_limit_key_and_never_logged(
    start_proxy: Starter, capfd: pytest.CaptureFixture[str]
) -> None:
    proxy = start_proxy(
        rate_limit=1, api_keys="key-alpha-123456,key-beta-654321:bob",
        log_level="debug",
    )
    ask(proxy, "key-alpha-123456")
    error = refused(proxy, "key-alpha-123456")
    assert_envelope(error, "rate_limit_exceeded")
    ask(proxy, "key-beta-654321")
    # The pass-through counts against the same bucket.
    with httpx.Client(base_url=proxy.base_url, timeout=20) as http:
        models = http.get("/models", headers={"Authorization": "Bearer key-beta-654321"})
    assert models.status_code == 429 and models.json()["error"]["type"] == "rate_limit_error"
    logs = capfd.readouterr()
    assert '"status": 429' in logs.err or '"status":429' in logs.err  # the refusal was logged
    for raw in ("key-alpha-123456", "key-beta-654321"):
        assert raw not in logs.err and raw not in logs.out
        assert raw not in error.response.text


def test_the_memory_api_shares_the_key_s_bucket_and_its_429(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True, rate_limit=2, api_keys="key-alpha-123456:ann,key-beta-654321:bob")
    alpha = {"Authorization": "Bearer key-alpha-123456"}
    with httpx.Client(base_url=f"{proxy.url}/v1/memory", timeout=20) as api:
        assert api.get("/facts", headers=alpha).status_code == 200
        assert api.post("/facts", headers=alpha, json={
            "text": "Ann keeps bees", "category": "identity"}).status_code == 201
        for refused_call in (api.get("/facts", headers=alpha), api.get("/stats", headers=alpha),
                             api.post("/clear", headers=alpha)):
            assert refused_call.status_code == 429, refused_call.text
            error = refused_call.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert 1 <= int(refused_call.headers["retry-after"]) <= 30
        # The refused clear did nothing; the chat of that key counts against the same bucket.
        with closing(sqlite3.connect(proxy.state.settings.db_path)) as conn:
            assert conn.execute("SELECT count(*) FROM facts").fetchone() == (1,)
        assert_envelope(refused(proxy, "key-alpha-123456"), "rate_limit_exceeded")
        # Another key has its own bucket; a wrong key is a 401 before any limit.
        assert api.get("/facts", headers={"Authorization": "Bearer key-beta-654321"}).status_code == 200
        assert api.get("/facts", headers={"Authorization": "Bearer nope"}).status_code == 401
    ask(proxy, "key-beta-654321")
    assert_envelope(refused(proxy, "key-beta-654321"), "rate_limit_exceeded")


def test_limit_key_hashes_keys() -> None:
    hashed = limit_key(None, {"authorization": "Bearer sk-secret-value"}, "ann")
    assert "sk-secret-value" not in hashed and hashed.startswith("key:")
    # A proxy key's bucket is named by its key_id (a stored key's row id), never its secret.
    proxy_key = ApiKey("sk-secret-value", None)
    assert limit_key(proxy_key, {}, "bob") == "key:" + proxy_key.key_id
    assert limit_key(ApiKey("digest", key_id="key_0123"), {}, "bob") == "key:key_0123"
    assert limit_key(None, {}, "ann") == "user:ann"
    assert limit_key(None, {"x-api-key": "other"}, "ann") != hashed


# -- concurrent streams --------------------------------------------------------------------


def slow_stream(events: int = 20, delay: float = 0.25) -> SSEReply:
    return SSEReply(chat_chunks("x " * events, split=events), delay=delay)


def test_stream_limit_and_release_when_the_stream_ends(
    start_proxy: Starter, upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(max_streams_per_key=1)
    # Three seconds of stream: the checks below run while it is open.
    upstream.enqueue(slow_stream(events=10, delay=0.3), path="/v1/chat/completions")
    with sdk(proxy) as client:
        first = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)
        error = refused(proxy, stream=True)
        assert assert_envelope(error, "concurrency_limit_exceeded") == 1
        ask(proxy)  # a request that does not stream is not held back
        refused(proxy, stream=True)
        ask(proxy, "sk-client-b")  # nor is another key
        text = "".join(chunk.choices[0].delta.content or "" for chunk in first if chunk.choices)
        assert text.strip() == " ".join("x" * 10)
        wait_streams(proxy, "sk-client-a", 0)
        again = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in again if c.choices).startswith("echo")


def test_stream_slot_is_released_when_the_client_disconnects(
    start_proxy: Starter, upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(max_streams_per_key=1)
    upstream.enqueue(slow_stream(events=40, delay=0.25), path="/v1/chat/completions")
    body = {"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True}
    headers = {"Authorization": "Bearer sk-client-a"}
    with httpx.Client(base_url=proxy.base_url, timeout=20, headers=headers) as http:
        with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()  # held: a dropped generator would close the stream
            assert next(chunks).startswith(b"data: ")
            assert wait_streams(proxy, "sk-client-a", 1) < 1
            busy = http.post("/chat/completions", json=body)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        # The client hung up after the first chunk; the stream had 10 s left to run.
        assert wait_streams(proxy, "sk-client-a", 0) < 3
        again = http.post("/chat/completions", json=body)
    assert again.status_code == 200 and b"data: [DONE]" in again.content


def test_stream_slot_is_released_when_the_upstream_fails(
    start_proxy: Starter, upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(max_streams_per_key=1)
    upstream.enqueue(
        SSEReply(chat_chunks("one two three", split=3), cut_after=2),  # cut mid-stream
        ErrorReply(500, "upstream broke"),  # fails before the stream starts
        path="/v1/chat/completions",
    )
    body = {"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True}
    headers = {"Authorization": "Bearer sk-client-a"}
    with httpx.Client(base_url=proxy.base_url, timeout=20, headers=headers) as http:
        cut = http.post("/chat/completions", json=body)
        assert cut.status_code == 200 and b"event: error" in cut.content
        wait_streams(proxy, "sk-client-a", 0)
        failed = http.post("/chat/completions", json=body)
        assert failed.status_code == 500
        wait_streams(proxy, "sk-client-a", 0)
        ok = http.post("/chat/completions", json=body)
    assert ok.status_code == 200 and b"data: [DONE]" in ok.content


# -- the bucket's arithmetic ---------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_retry_after_is_the_time_until_the_bucket_holds_a_request() -> None:
    clock = Clock()
    limits = KeyLimits(6, 1, clock=clock)  # one request per 10 s, one at a time
    limits.admit("k", stream=False)
    clock.now += 3.5

    def retry_after() -> int:
        with pytest.raises(RateLimited) as refused:
            limits.admit("k", stream=False)
        return int(refused.value.headers["Retry-After"])

    assert retry_after() == 7  # 6.5 s to go, rounded up
    clock.now += 6
    assert retry_after() == 1  # 0.5 s to go: refusals took nothing
    clock.now += 1
    assert limits.admit("k", stream=False) is None
    assert limits.admit("other", stream=False) is None  # keys do not share a bucket


def test_idle_keys_are_forgotten_and_open_streams_are_not() -> None:
    clock = Clock()
    limits = KeyLimits(60, 0, 1, clock=clock)
    slot = limits.admit("streaming", stream=True)
    for i in range(3000):
        limits.admit(f"early:{i}", stream=False)
    assert limits.tracked_keys == 3001  # nothing refilled yet: nothing to forget
    clock.now += 120  # every early bucket is full again, the stream still open
    for i in range(2048):
        limits.admit(f"late:{i}", stream=False)
    assert limits.tracked_keys == 1 + 2048
    assert limits.open_streams("streaming") == 1
    assert slot is not None
    slot.release()
    slot.release()  # idempotent
    assert limits.open_streams("streaming") == 0


@settings(max_examples=200, deadline=None)
@given(
    rate=st.integers(1, 600),
    burst=st.integers(0, 20),
    gaps=st.lists(st.floats(0, 30, allow_nan=False), min_size=1, max_size=40),
)
def test_waiting_retry_after_is_always_enough_and_the_rate_holds(
    rate: int, burst: int, gaps: list[float]
) -> None:
    clock = Clock()
    limits = KeyLimits(rate, burst, clock=clock)
    admitted = 0
    for gap in gaps:
        clock.now += gap
        try:
            limits.admit("k", stream=False)
        except RateLimited as exc:
            wait = int(exc.headers["Retry-After"])
            assert 1 <= wait <= math.ceil(60 / rate)  # never longer than one refill
            clock.now += wait
            limits.admit("k", stream=False)  # waiting Retry-After seconds is enough
        admitted += 1
    allowed = (burst or rate) + (clock.now - 1000.0) * rate / 60
    assert admitted <= allowed + 1e-6  # never more than the bucket and the rate allow
