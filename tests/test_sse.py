"""The SSE decoder and the chat-reply tee, fed at awkward byte boundaries."""

from __future__ import annotations

from itertools import pairwise

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.http.sse import ChatReplyTee, ServerSentEvent, SSEDecoder, decode, encode, frames

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


# Every blank line a stream may send: each pair of terminators (LF, CR, CRLF), and a comment.
MIXED = (
    b"data: 1\n\n" b"data: 2\r\r" b"data: 3\r\n\r\n" b"data: 4\n\r\n" b"data: 5\r\n\n"
    b"data: 6\r\r\n" b"data: 7\n\r" b"data: 8\r\n\r" b": ping\n\n" b"event: end\ndata: 9\n\n"
)
MIXED_EVENTS = [*(ServerSentEvent(str(n)) for n in range(1, 9)), ServerSentEvent("9", "end")]


def test_the_cut_passes_whole_events_only_and_every_byte() -> None:
    """What a relay that holds partial events sends: the bytes as they came, in whole events."""
    for cut in range(len(MIXED) + 1):
        cutter, reader = SSEDecoder(), SSEDecoder()
        sent = [cutter.whole(MIXED[:cut]), cutter.whole(MIXED[cut:])]
        assert b"".join(sent) + cutter.end() == MIXED, cut
        # Each part read alone holds only whole events: none is left half-read.
        assert [e for part in sent for e in SSEDecoder().feed(part)] == MIXED_EVENTS, cut
        assert [e for part in sent for e in reader.feed(part)] == MIXED_EVENTS, cut


@given(st.lists(st.integers(min_value=0, max_value=len(MIXED)), max_size=12))
def test_the_cut_at_arbitrary_splits(cuts: list[int]) -> None:
    cutter = SSEDecoder()
    bounds = [0, *sorted(set(cuts)), len(MIXED)]
    sent = [cutter.whole(MIXED[a:b]) for a, b in pairwise(bounds)]
    assert b"".join(sent) + cutter.end() == MIXED
    assert [e for part in sent for e in SSEDecoder().feed(part)] == MIXED_EVENTS


def test_the_cut_holds_an_unfinished_event_until_its_blank_line() -> None:
    cutter = SSEDecoder()
    assert cutter.whole(b"data: 1\n\ndata: 2\r\n") == b"data: 1\n\n"
    assert cutter.held_size == len(b"data: 2\r\n")
    assert cutter.whole(b"\r") == b"data: 2\r\n\r"  # a CR ends the blank line
    assert cutter.whole(b"\ndata: 3") == b""  # that CR's LF, then an event begun
    assert cutter.whole(b"\n") == b""
    assert cutter.whole(b"\rdata: 4") == b"\ndata: 3\n\r"  # the blank line's pair across reads
    assert cutter.end() == b"data: 4" and cutter.held_size == 0 and cutter.end() == b""


def test_frames_and_decode_read_every_event_an_unfinished_last_one_too() -> None:
    parts = frames(MIXED + b"data: 10")
    assert b"".join(parts) == MIXED + b"data: 10"
    assert [decode(part) for part in parts] == [
        [ServerSentEvent(str(n))] for n in range(1, 9)] + [[], [ServerSentEvent("9", "end")],
                                                           [ServerSentEvent("10")]]
    assert decode(MIXED + b"data: 10") == [*MIXED_EVENTS, ServerSentEvent("10")]
    assert SSEDecoder().feed(MIXED + b"data: 10") == MIXED_EVENTS  # a relay waits for its end


@given(st.text(alphabet=st.characters(exclude_characters="\r", exclude_categories=["Cs"]),
               max_size=40),
       st.one_of(st.none(), st.sampled_from(["error", "message_start", "response.completed"])))
def test_what_encode_writes_decodes_as_it_was(data: str, name: str | None) -> None:
    assert SSEDecoder().feed(encode(data, name)) == [ServerSentEvent(data, name)]
    assert encode(data.encode(), name) == encode(data, name)


def test_encode_writes_the_frames_the_apis_send() -> None:
    assert encode(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert encode(b"[DONE]") == b"data: [DONE]\n\n"
    assert encode(b'{"type":"error"}', "error") == b'event: error\ndata: {"type":"error"}\n\n'
    assert encode("two\nlines") == b"data: two\ndata: lines\n\n"
