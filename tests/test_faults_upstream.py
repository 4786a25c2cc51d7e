"""Upstream faults through a running memproxy with memory on, and upstream retries.

Each case checks what the client gets (a status in OpenAI's envelope, or one SSE error event
after a stream started), that a request the upstream never answered stored nothing, that a
stream cut midway stored the user's turn exactly once and its reply either not at all or
flagged incomplete, and that no job is left queued, running or dead. tests/test_gateway_errors.py covers the same statuses without memory.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.upstream.client import RETRY_MAX_DELAY, retry_after
from tests.conftest import RunningProxy
from tests.support.scripted_upstream import (
    Drop,
    ErrorReply,
    Hang,
    RawReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)

MODES = ("json", "stream")
REPLY = "one two three four five six"


@dataclass
class Answer:
    """What the client got: status, headers and the whole body."""

    status: int
    headers: httpx.Headers
    body: bytes

    def error(self) -> dict[str, Any]:
        """The error envelope of a JSON error answer."""
        assert self.headers["content-type"].startswith("application/json"), self.body
        error = orjson.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        return error  # type: ignore[no-any-return]

    def stream_error(self) -> dict[str, Any]:
        """The single SSE error event that ends a stream that had started."""
        assert self.status == 200
        assert self.headers["content-type"].startswith("text/event-stream")
        assert self.body.count(b"event: error") == 1, self.body
        assert b"[DONE]" not in self.body
        last = self.body.rstrip(b"\n").split(b"\n\n")[-1]
        event, data = last.split(b"\n")
        assert event == b"event: error"
        error = orjson.loads(data.removeprefix(b"data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error  # type: ignore[no-any-return]


class Chat:
    """Sends chat completions for one fresh user and reads back what memproxy stored."""

    def __init__(self, proxy: RunningProxy) -> None:
        self.proxy = proxy
        self.user = f"u-{uuid.uuid4().hex[:12]}"
        self.prompt = f"Remember that my locker code is {uuid.uuid4().hex[:6]}."
        self.sent = 0

    def send(self, mode: str, timeout: float = 30) -> Answer:
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": self.prompt}],
                "stream": mode == "stream"}
        headers = {"X-Memory-User-Id": self.user, "Authorization": "Bearer sk-test"}
        self.sent += 1
        with httpx.Client(timeout=timeout) as client, client.stream(
            "POST", f"{self.proxy.base_url}/chat/completions", json=body, headers=headers
        ) as response:
            return Answer(response.status_code, response.headers, response.read())

    def turns(self) -> list[tuple[str, str, int]]:
        """(role, content, incomplete) of every stored turn of this user, in order."""
        settle(self.proxy, self.user, self.sent)
        with read_only(self.proxy) as db:
            rows = db.execute(
                "SELECT role, content, incomplete FROM turns WHERE user_id = ? ORDER BY id",
                (self.user,),
            ).fetchall()
        return [(str(role), str(content), int(flag)) for role, content, flag in rows]

    def assert_user_turn_only(self) -> None:
        """The cut stream's user turn is stored once and no assistant turn is."""
        assert self.turns() == [("user", self.prompt, 0)]

    def assert_nothing_stored(self) -> None:
        """The unanswered request left no turn: its retry resends the message."""
        assert self.turns() == []


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks)


def read_only(proxy: RunningProxy) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{proxy.state.settings.db_path}?mode=ro", uri=True)


def settle(proxy: RunningProxy, user: str, requests: int, timeout: float = 20) -> None:
    """Wait until the user's requests are finished (each one's metrics row is written last,
    after its reply was stored) and the job queue is idle, then insist no job is stuck or dead."""
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    finished = 0
    while time.monotonic() < deadline:
        time.sleep(0.05)
        with read_only(proxy) as db:
            finished = db.execute("SELECT count(*) FROM request_metrics WHERE user_id = ?", (user,)).fetchone()[0]
            counts = dict(db.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
        if finished >= requests and not counts.get("queued") and not counts.get("running"):
            break
    assert finished == requests, f"{finished} of {requests} requests finished"
    assert not counts.get("queued") and not counts.get("running"), counts
    assert not counts.get("dead"), counts


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True, upstream_timeout=1.0)


# -- before the response starts: a status in OpenAI's envelope ------------------------------


@pytest.mark.parametrize("where", ["refused", "dns"])
def test_unreachable_upstream_is_502_and_nothing_is_stored(
    start_proxy: Callable[..., RunningProxy], where: str
) -> None:
    base = f"http://127.0.0.1:{closed_port()}/v1" if where == "refused" else "http://nonexistent.invalid:1/v1"
    proxy = start_proxy(memory=True, upstream_base_url=base)
    for mode in MODES:
        chat = Chat(proxy)
        answer = chat.send(mode)
        assert answer.status == 502
        error = answer.error()
        assert (error["type"], error["code"]) == ("api_error", "upstream_unreachable")
        chat.assert_nothing_stored()


def test_timeout_before_headers_is_504(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    for count, mode in enumerate(MODES, start=1):
        upstream.enqueue(Hang(30))
        chat = Chat(memproxy)
        started = time.monotonic()
        answer = chat.send(mode)
        assert time.monotonic() - started < 10  # gave up after upstream_timeout, not the hang
        assert answer.status == 504
        assert answer.error()["code"] == "upstream_timeout"
        chat.assert_nothing_stored()
        assert len(upstream.history) == count


@pytest.mark.parametrize("mode", MODES)
def test_upstream_error_status_keeps_status_envelope_and_retry_after(
    memproxy: RunningProxy, upstream: ScriptedUpstream, mode: str
) -> None:
    cases = [(status, after) for status in (429, 500, 502, 503) for after in (None, "7")]
    for count, (status, after) in enumerate(cases, start=1):
        upstream.enqueue(ErrorReply(status, f"upstream says {status}", headers={"retry-after": after} if after else {}))
        chat = Chat(memproxy)
        answer = chat.send(mode)
        assert answer.status == status
        error = answer.error()
        assert error["message"] == f"upstream says {status}"
        assert error["type"] == ("requests" if status == 429 else "server_error")
        assert answer.headers.get("retry-after") == after
        chat.assert_nothing_stored()
        assert len(upstream.history) == count  # retries are off by default


def test_invalid_json_body_with_200_is_502(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    for mode in MODES:  # a streamed request answered with a plain JSON body is read the same way
        upstream.enqueue(RawReply(b'{"id": "chatcmpl-1", "choices": [{"message": ', content_type="application/json"))
        chat = Chat(memproxy)
        answer = chat.send(mode)
        assert answer.status == 502
        error = answer.error()
        assert (error["type"], error["code"]) == ("api_error", "upstream_invalid_response")
        chat.assert_nothing_stored()


def test_the_sdk_sees_an_invalid_body_as_a_server_error(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    upstream.enqueue(RawReply(b"[1, 2, 3]", content_type="application/json"))
    client = openai.OpenAI(base_url=memproxy.base_url, api_key="sk-test", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502


# -- slow bodies: the timeout is between bytes, not for the whole body ----------------------


def test_a_slow_json_body_within_the_timeout_completes(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    body = orjson.dumps(chat_completion(REPLY))
    pieces = 8
    upstream.enqueue(RawReply(body, content_type="application/json", chunk_size=len(body) // pieces + 1,
                              chunk_delay=0.2))
    chat = Chat(memproxy)
    started = time.monotonic()
    answer = chat.send("json")
    assert time.monotonic() - started > 1.0  # longer than upstream_timeout, in small gaps
    assert answer.status == 200
    assert answer.body == body
    assert chat.turns() == [("user", chat.prompt, 0), ("assistant", REPLY, 0)]


def test_a_json_body_that_stalls_past_the_timeout_is_504(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    body = orjson.dumps(chat_completion(REPLY))
    upstream.enqueue(RawReply(body, content_type="application/json", chunk_size=20, chunk_delay=5))
    chat = Chat(memproxy)
    started = time.monotonic()
    answer = chat.send("json")
    assert time.monotonic() - started < 4
    assert answer.status == 504
    assert answer.error()["code"] == "upstream_timeout"
    chat.assert_nothing_stored()


def test_a_slow_stream_within_the_timeout_completes(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    upstream.enqueue(SSEReply(chat_chunks(REPLY, split=6), delay=0.2))
    chat = Chat(memproxy)
    started = time.monotonic()
    answer = chat.send("stream")
    assert time.monotonic() - started > 1.0
    assert answer.status == 200
    assert answer.body.endswith(b"data: [DONE]\n\n")
    assert b"event: error" not in answer.body
    assert chat.turns() == [("user", chat.prompt, 0), ("assistant", REPLY, 0)]


def test_a_stream_that_stalls_past_the_timeout_ends_in_one_error_event(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    chunks = chat_chunks(REPLY, split=6)
    upstream.enqueue(SSEReply(chunks, stall=(3, 30)))  # role + 2 pieces, then nothing
    chat = Chat(memproxy)
    started = time.monotonic()
    answer = chat.send("stream")
    assert time.monotonic() - started < 10
    assert answer.stream_error()["code"] == "upstream_timeout"
    assert answer.body.count(b"data: {") == 4  # the three events that arrived, then the error
    partial = text_of(chunks[1:3])
    assert chat.turns() == [("user", chat.prompt, 0), ("assistant", partial, 1)]


# -- after the stream started: one SSE error event ------------------------------------------


def test_a_stream_cut_after_n_chunks_stores_the_partial_reply_flagged(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(SSEReply(chat_chunks(REPLY, split=6), cut_after=4, delay=0.05))  # role + 3 pieces
    chat = Chat(memproxy)
    answer = chat.send("stream")
    assert answer.stream_error()["code"] == "upstream_unreachable"
    partial = text_of(chat_chunks(REPLY, split=6)[1:4])
    assert chat.turns() == [("user", chat.prompt, 0), ("assistant", partial, 1)]


def test_a_stream_cut_before_any_text_stores_no_reply(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    upstream.enqueue(SSEReply(chat_chunks(REPLY), cut_after=1))  # the role chunk only
    chat = Chat(memproxy)
    assert chat.send("stream").stream_error()["code"] == "upstream_unreachable"
    chat.assert_user_turn_only()


def test_a_malformed_sse_line_becomes_one_error_event(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    chunks: list[Any] = chat_chunks(REPLY, split=6)
    events = [*chunks[:3], 'data: {"choices": [{"delta": {"content": "tr\n\n', *chunks[3:]]
    upstream.enqueue(SSEReply(events))
    chat = Chat(memproxy)
    answer = chat.send("stream")
    error = answer.stream_error()
    assert (error["type"], error["code"]) == ("api_error", "upstream_invalid_response")
    assert b'"tr' not in answer.body  # the broken event never reached the client
    assert answer.body.count(b"data: {") == 4  # the three events before it, then the error
    partial = text_of(chunks[1:3])
    assert chat.turns() == [("user", chat.prompt, 0), ("assistant", partial, 1)]


def test_the_sdk_raises_an_api_error_on_a_malformed_event(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    chunks: list[Any] = chat_chunks(REPLY, split=6)
    upstream.enqueue(SSEReply([*chunks[:2], "data: not json at all\n\n", *chunks[2:]]))
    client = openai.OpenAI(base_url=memproxy.base_url, api_key="sk-test", max_retries=0)
    received: list[str] = []
    with pytest.raises(openai.APIError, match="malformed"):
        for chunk in client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == text_of(chunks[1:2])  # what came before the broken event


def test_events_split_across_reads_are_relayed_whole(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    body = b"".join(b"data: " + orjson.dumps(c) + b"\r\n\r\n" for c in chat_chunks(REPLY, split=6))
    upstream.enqueue(RawReply(body + b"data: [DONE]\r\n\r\n", content_type="text/event-stream",
                              chunk_size=7, chunk_delay=0.002))
    chat = Chat(memproxy)
    answer = chat.send("stream")
    assert answer.status == 200
    assert answer.body == body + b"data: [DONE]\r\n\r\n"  # byte for byte, however it was cut
    assert chat.turns() == [("user", chat.prompt, 0), ("assistant", REPLY, 0)]


# -- retries ----------------------------------------------------------------------------------


@pytest.fixture
def retrying(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True, upstream_timeout=1.0, upstream_retries=2)


@pytest.mark.parametrize("mode", MODES)
def test_retries_recover_from_503_and_a_dropped_connection(
    retrying: RunningProxy, upstream: ScriptedUpstream, mode: str
) -> None:
    upstream.enqueue(ErrorReply(503, "overloaded"), Drop())
    chat = Chat(retrying)
    answer = chat.send(mode)
    assert answer.status == 200
    assert len(upstream.history) == 3
    assert all(received.body == upstream.history[0].body for received in upstream.history)
    echo = f"echo: {chat.prompt}"
    assert chat.turns() == [("user", chat.prompt, 0), ("assistant", echo, 0)]  # each once


@pytest.mark.parametrize("mode", MODES)
def test_retries_stop_at_the_limit(retrying: RunningProxy, upstream: ScriptedUpstream, mode: str) -> None:
    upstream.enqueue(*[ErrorReply(429, "slow down", headers={"retry-after": "0"})] * 4)
    chat = Chat(retrying)
    answer = chat.send(mode)
    assert answer.status == 429
    assert answer.error()["message"] == "slow down"
    assert answer.headers["retry-after"] == "0"
    assert len(upstream.history) == 3  # the first try and two retries
    assert upstream.pending == 1
    chat.assert_nothing_stored()


def test_retries_back_off_and_honour_retry_after(retrying: RunningProxy, upstream: ScriptedUpstream) -> None:
    upstream.enqueue(ErrorReply(502, "bad gateway"), ErrorReply(503, "wait", headers={"retry-after": "1"}))
    started = time.monotonic()
    assert Chat(retrying).send("json").status == 200
    elapsed = time.monotonic() - started
    assert len(upstream.history) == 3
    # The first backoff is 0.125-0.25 s (jittered), the second wait is the asked 1 s.
    assert 1.1 <= elapsed < 3, elapsed


@pytest.fixture
def full_backlog() -> Iterator[str]:
    """A base URL whose listen queue is full: connecting times out, nothing is ever sent."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = [socket.socket() for _ in range(3)]
    for sock in queued:
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
    yield f"http://127.0.0.1:{port}/v1"
    for sock in [*queued, server]:
        sock.close()


class RetryLog(logging.Handler):
    """The upstream module's retry warnings (memproxy's logger does not propagate)."""

    def __init__(self) -> None:
        super().__init__()
        self.retries: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "upstream retry":
            self.retries.append({"attempt": record.__dict__["attempt"], "error": record.__dict__["error"]})


def test_a_connect_timeout_is_retried(start_proxy: Callable[..., RunningProxy], full_backlog: str) -> None:
    proxy = start_proxy(memory=True, upstream_base_url=full_backlog, upstream_connect_timeout=0.2,
                        upstream_retries=2)
    log = RetryLog()
    logging.getLogger("memproxy.upstream").addHandler(log)
    try:
        chat = Chat(proxy)
        answer = chat.send("stream")
    finally:
        logging.getLogger("memproxy.upstream").removeHandler(log)
    assert answer.status == 504
    assert answer.error()["code"] == "upstream_timeout"
    assert log.retries == [{"attempt": 1, "error": "upstream_timeout"}, {"attempt": 2, "error": "upstream_timeout"}]
    chat.assert_nothing_stored()


def test_what_is_not_retried(retrying: RunningProxy, upstream: ScriptedUpstream) -> None:
    too_long = str(int(RETRY_MAX_DELAY) + 60)
    cases: list[tuple[Any, int]] = [
        (ErrorReply(503, "maintenance", headers={"retry-after": too_long}), 503),  # the client decides
        *[(ErrorReply(status, "no"), status) for status in (400, 401, 404, 500)],
        (Hang(30), 504),  # a read timeout: the upstream may still be working on it
        (RawReply(b"not json", content_type="application/json"), 502),  # a 200 was answered
    ]
    for count, (reply, status) in enumerate(cases, start=1):
        upstream.enqueue(reply)
        started = time.monotonic()
        answer = Chat(retrying).send("json")
        assert answer.status == status
        assert time.monotonic() - started < 3
        assert len(upstream.history) == count, reply
        if count == 1:
            assert answer.headers["retry-after"] == too_long


def test_a_failure_after_the_first_byte_is_never_retried(retrying: RunningProxy, upstream: ScriptedUpstream) -> None:
    chunks = chat_chunks(REPLY, split=6)
    replies = [
        SSEReply(chunks, cut_after=3, delay=0.05),
        SSEReply([*chunks[:2], "data: {oops\n\n"]),
        SSEReply(chunks, stall=(2, 30)),
    ]
    for count, reply in enumerate(replies, start=1):
        upstream.enqueue(reply)
        chat = Chat(retrying)
        chat.send("stream").stream_error()
        assert len(upstream.history) == count
        turns = chat.turns()
        assert turns[0] == ("user", chat.prompt, 0)
        assert [(role, flag) for role, _, flag in turns[1:]] == [("assistant", 1)]


def test_retry_after_forms() -> None:
    assert retry_after({"Retry-After": "2"}) == 2.0
    assert retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({"retry-after-ms": "later", "Retry-After": "3"}) == 3.0
    assert retry_after({"retry-after": "nan"}) is None
    assert retry_after({}) is None
    in_three = retry_after({"Retry-After": formatdate(time.time() + 3, usegmt=True)})
    assert in_three is not None and 1.5 < in_three <= 3.0
    assert retry_after({"Retry-After": formatdate(time.time() - 60, usegmt=True)}) == 0.0
