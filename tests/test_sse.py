"""The SSE decoder and the chat-reply tee, fed at awkward byte boundaries."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.http.sse import ChatReplyTee, ServerSentEvent, SSEDecoder

STREAM = (
    b": keep-alive comment\r\n"
    b"data: {\"a\": 1}\r\n\r\n"
    b"event: error\ndata: line one\ndata: line two\n\n"
    b"id: 7\rdata: caf\xc3\xa9\r\r"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ServerSentEvent('{"a": 1}'),
    ServerSentEvent("line one\nline two", event="error"),
    ServerSentEvent("café", id="7"),
    ServerSentEvent("[DONE]", id="7"),  # the last event id persists (WHATWG)
]


def decode_in_pieces(data: bytes, cuts: list[int]) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    events = []
    start = 0
    for cut in [*sorted(set(cuts)), len(data)]:
        events += decoder.feed(data[start:cut])
        start = cut
    return events


def test_whole_stream_decodes() -> None:
    assert SSEDecoder().feed(STREAM) == EXPECTED


def test_every_single_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        assert decode_in_pieces(STREAM, [cut]) == EXPECTED, cut


def test_byte_at_a_time() -> None:
    assert decode_in_pieces(STREAM, list(range(len(STREAM)))) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_arbitrary_splits(cuts: list[int]) -> None:
    assert decode_in_pieces(STREAM, cuts) == EXPECTED


def chunk(content: str | None = None, finish: str | None = None, index: int = 0) -> bytes:
    delta = {} if content is None else {"content": content}
    payload = {"object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def test_tee_collects_choice_zero_split_anywhere() -> None:
    data = chunk("Hel") + chunk("lo", index=1) + chunk("lo ") + chunk("wörld") + chunk(
        finish="stop") + b"data: [DONE]\n\n"
    for cut in range(len(data)):
        tee = ChatReplyTee()
        tee.feed(data[:cut])
        tee.feed(data[cut:])
        assert tee.text == "Hello wörld"
        assert tee.finished


def test_tee_renders_tool_calls_and_notes_errors() -> None:
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"name": "get_weather", "arguments": '{"city":'}}]}}]}
    more = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '"Oslo"}'}}]}}]}
    tee = ChatReplyTee()
    tee.feed(b"data: " + orjson.dumps(call) + b"\n\ndata: " + orjson.dumps(more) + b"\n\n")
    assert tee.text == '[tool call] get_weather({"city":"Oslo"})'
    tee.feed(b'event: error\ndata: {"error": {"message": "boom"}}\n\n')
    assert tee.errored and not tee.finished
