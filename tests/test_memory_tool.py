"""Memory as a tool (X-Memory-Mode: tool) through the real stack: the official SDK, memproxy
with real storage and recall, the scripted upstream scripted to call memory_search."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from proxy.flow.memory_tool.chat import ChatRound
from proxy.flow.memory_tool.dialect import TOOL_NAME
from proxy.flow.memory_tool.loop import FAILED
from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import (
    ErrorReply,
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)

NOTE = "The billing service runs on Postgres 16 with the pgvector extension."
QUESTION = "Which database does the billing service use in production these days?"
SEARCH = {"name": TOOL_NAME, "arguments": {"query": "billing service database"}}
WEATHER_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city.",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
WEATHER = {"id": "call_weather", "name": "get_weather", "arguments": {"city": "Lisbon"}}
TOOL_HEADERS = {"X-Memory-Mode": "tool", "X-Memory-Session-Id": "now"}


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    """Tool mode without a pre-fetched block, and one note in memory from another session."""
    proxy = start_proxy(memory=True, memory_tool_prefetch=0)
    remember_note(proxy)
    return proxy


def remember_note(proxy: RunningProxy) -> None:
    line = json.dumps({"type": "turn", "session_id": "old", "role": "user", "content": NOTE})
    imported = httpx.post(f"{proxy.url}/v1/memory/import", content=line, timeout=60)
    assert imported.json()["added"]["turns"] == 1, imported.text
    wait_for_jobs(proxy)


@pytest.fixture
def client(memproxy: RunningProxy) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=memproxy.base_url, api_key="sk-test", max_retries=0, timeout=60,
                       default_headers=TOOL_HEADERS) as sdk:
        yield sdk


def chat_requests(upstream: ScriptedUpstream) -> list[Received]:
    return [r for r in upstream.history if r.path == "/v1/chat/completions"]


def tool_names(received: Received) -> list[str]:
    return [t["function"]["name"] for t in received.json.get("tools", [])]


def stored_turns(proxy: RunningProxy, session: str = "now") -> list[tuple[str, str]]:
    wait_for_jobs(proxy)
    with closing(sqlite3.connect(proxy.state.settings.db_path)) as conn:
        return conn.execute("SELECT role, content FROM turns WHERE session_id = ? ORDER BY id",
                            (session,)).fetchall()


def test_the_proxy_answers_memory_search_and_the_client_gets_only_the_answer(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(JSONReply(chat_completion(None, tool_calls=[SEARCH])),
                     JSONReply(chat_completion("Postgres 16.", prompt_tokens=30)))
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    reply = raw.parse()
    first, second = chat_requests(upstream)
    assert tool_names(first) == [TOOL_NAME]
    asked, answered = second.json["messages"][-2:]
    assert asked["role"] == "assistant" and asked["tool_calls"][0]["function"]["name"] == TOOL_NAME
    assert answered["role"] == "tool" and answered["tool_call_id"] == asked["tool_calls"][0]["id"]
    assert NOTE in answered["content"] and "<memory>" in answered["content"]
    choice = reply.choices[0]
    assert choice.message.content == "Postgres 16." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens == 10 + 30  # both rounds
    assert raw.headers["x-memory-mode"] == "tool"
    assert raw.headers["x-memory-tool-searches"] == "1"
    assert "x-memory-error" not in raw.headers
    # The turn log holds what the client sent and received, not the internal round.
    assert stored_turns(memproxy) == [("user", QUESTION), ("assistant", "Postgres 16.")]
    metrics = httpx.get(f"{memproxy.url}/metrics").text
    assert 'memproxy_memory_tool_searches_total{outcome="found"} 1.0' in metrics


def test_a_stream_hides_the_tool_round_and_relays_text_of_every_round(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(SSEReply(chat_chunks("Let me check. ", tool_calls=[SEARCH], include_usage=True)),
                     SSEReply(chat_chunks("It is Postgres 16.", include_usage=True, prompt_tokens=30)))
    chunks = list(client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": QUESTION}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me check. It is Postgres 16."
    assert all(c.choices[0].delta.tool_calls is None for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == 10 + 30
    answered = chat_requests(upstream)[1].json["messages"]
    assert answered[-2]["content"] == "Let me check. " and NOTE in answered[-1]["content"]
    assert stored_turns(memproxy) == [("user", QUESTION), ("assistant", text)]


@dataclass
class Answer:
    """What the client got: the text, and the tool calls by index (id, name, arguments)."""

    text: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)


def ask(sdk: openai.OpenAI, content: str, *, stream: bool) -> Answer:
    """One chat completion offering the client's get_weather tool, streamed or not."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": content}]
    answer = Answer()
    if not stream:
        message = sdk.chat.completions.create(model="gpt-4o", messages=messages,
                                              tools=[WEATHER_TOOL]).choices[0].message
        answer.text = message.content or ""
        for i, call in enumerate(message.tool_calls or ()):
            assert call.type == "function"
            answer.calls[i] = [call.id, call.function.name, call.function.arguments]
        return answer
    for chunk in sdk.chat.completions.create(model="gpt-4o", messages=messages,
                                             tools=[WEATHER_TOOL], stream=True):
        delta = chunk.choices[0].delta
        answer.text += delta.content or ""
        for part in delta.tool_calls or ():
            got = answer.calls.setdefault(part.index, ["", "", ""])
            function = part.function
            got[0] += part.id or ""
            got[1] += function.name or "" if function else ""
            got[2] += function.arguments or "" if function else ""
    return answer


@pytest.mark.parametrize("stream", [False, True])
def test_client_tools_pass_through_untouched(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream, stream: bool
) -> None:
    upstream.enqueue(reply([WEATHER], stream=stream))
    answer = ask(client, "What is the weather in Lisbon right now?", stream=stream)
    assert answer.calls == {0: ["call_weather", "get_weather", '{"city":"Lisbon"}']}
    (sent,) = chat_requests(upstream)
    assert tool_names(sent) == ["get_weather", TOOL_NAME]
    assert sent.json["tools"][0] == WEATHER_TOOL


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_calling_both_tools_runs_memory_search_first(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream, stream: bool
) -> None:
    upstream.enqueue(reply([WEATHER, SEARCH], stream=stream), reply([WEATHER], stream=stream))
    answer = ask(client, "Weather where the billing team sits, please?", stream=stream)
    assert [name for _, name, _ in answer.calls.values()] == ["get_weather"]
    second = chat_requests(upstream)[1]
    asked = second.json["messages"][-2]
    # The client's call of the searching turn is withheld: only the client can answer it.
    assert [c["function"]["name"] for c in asked["tool_calls"]] == [TOOL_NAME]
    assert second.json["messages"][-1]["role"] == "tool"


@pytest.mark.parametrize("stream", [False, True])
def test_rounds_are_bounded_and_a_late_call_is_stripped(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, stream: bool
) -> None:
    proxy = start_proxy(memory=True, memory_tool_rounds=2, memory_mode="tool")
    upstream.respond_with(lambda received: reply(
        [SEARCH, WEATHER], stream=stream, content="Thinking. ",
    ) if received.path == "/v1/chat/completions" else None)
    with openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0, timeout=60) as sdk:
        answer = ask(sdk, QUESTION, stream=stream)
    # The last round's memory_search is taken out, and the client's call numbered from 0.
    assert [(i, name) for i, (_, name, _) in answer.calls.items()] == [(0, "get_weather")]
    assert answer.text == ("Thinking. " * 3 if stream else "Thinking. ")
    sent = chat_requests(upstream)
    assert [tool_names(r) for r in sent] == [["get_weather", TOOL_NAME]] * 2 + [["get_weather"]]
    assert sum(m["role"] == "tool" for m in sent[-1].json["messages"]) == 2


def reply(calls: list[dict[str, Any]], *, stream: bool, content: str | None = None) -> Reply:
    """The scripted model calling `calls`, as a stream or a whole completion."""
    if stream:
        return SSEReply(chat_chunks(content, tool_calls=calls))
    return JSONReply(chat_completion(content, tool_calls=calls))


def test_a_failing_recall_inside_the_loop_still_answers(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    def embeddings(received: Received) -> Reply | None:
        return ErrorReply(503, "embeddings down") if received.path == "/v1/embeddings" else None

    upstream.respond_with(embeddings)
    proxy = start_proxy(memory=True, embedding_backend="upstream", upstream_api_key="sk-op",
                        job_max_attempts=1)
    upstream.enqueue(JSONReply(chat_completion(None, tool_calls=[SEARCH])),
                     JSONReply(chat_completion("I could not look that up.")),
                     path="/v1/chat/completions")
    # "hi" needs no recall, so the pre-fetch does not embed: only the tool's search fails.
    response = httpx.post(f"{proxy.base_url}/chat/completions", headers=TOOL_HEADERS, timeout=60,
                          json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "I could not look that up."
    assert response.headers["x-memory-error"].startswith(f"{TOOL_NAME}: ")
    assert chat_requests(upstream)[1].json["messages"][-1]["content"] == FAILED
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'memproxy_memory_tool_searches_total{outcome="failed"} 1.0' in metrics


def test_an_upstream_failing_in_a_later_round_ends_the_stream_with_one_error_event(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(SSEReply(chat_chunks("Let me check. ", tool_calls=[SEARCH])),
                     ErrorReply(500, "the model fell over"))
    pieces: list[str] = []
    with pytest.raises(openai.APIError, match="upstream returned 500"):
        for chunk in client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": QUESTION}], stream=True,
        ):
            pieces += [chunk.choices[0].delta.content or ""] if chunk.choices else []
    assert "".join(pieces) == "Let me check. "
    assert len(chat_requests(upstream)) == 2


def test_the_prefetched_block_is_small_and_the_setting_is_the_default(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, memory_mode="tool", memory_tool_prefetch=60)
    remember_note(proxy)
    message = {"role": "user", "content": QUESTION}
    tool = httpx.post(f"{proxy.base_url}/chat/completions", timeout=60,
                      json={"model": "gpt-4o", "messages": [message]})
    assert tool.headers["x-memory-mode"] == "tool"
    assert 0 < int(tool.headers["x-memory-injected-tokens"]) <= 60
    (sent,) = chat_requests(upstream)
    assert NOTE in sent.json["messages"][0]["content"] and tool_names(sent) == [TOOL_NAME]
    dry = httpx.post(f"{proxy.base_url}/chat/completions", timeout=60,
                     headers={"X-Memory-Dry-Run": "on"}, json={"model": "gpt-4o", "messages": [message]})
    assert dry.json()["budget"] == 60 and 0 < dry.json()["tokens"] <= 60
    injected = httpx.post(f"{proxy.base_url}/chat/completions", timeout=60,
                          headers={"X-Memory-Mode": "inject"},
                          json={"model": "gpt-4o", "messages": [message]})
    assert "x-memory-mode" not in injected.headers and "tools" not in upstream.history[-1].json
    bad = httpx.post(f"{proxy.base_url}/chat/completions", timeout=60,
                     headers={"X-Memory-Mode": "agent"},
                     json={"model": "gpt-4o", "messages": [message]})
    assert bad.status_code == 400 and "X-Memory-Mode" in bad.json()["error"]["message"]


def test_a_request_the_loop_cannot_serve_gets_injection_and_says_why(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    response = httpx.post(f"{memproxy.base_url}/chat/completions", headers=TOOL_HEADERS, timeout=60,
                          json={"model": "gpt-4o", "n": 2,
                                "messages": [{"role": "user", "content": QUESTION}]})
    assert response.status_code == 200
    assert response.headers["x-memory-mode"] == "inject (tool mode needs n=1)"
    (sent,) = chat_requests(upstream)
    assert NOTE in sent.json["messages"][0]["content"] and "tools" not in sent.json


def test_the_round_filter_reads_events_split_at_any_byte() -> None:
    events = chat_chunks("Hi there.", tool_calls=[WEATHER, SEARCH], include_usage=True)
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    whole = ChatRound(None)
    expected = whole.feed(wire) + whole.end()
    for size in (1, 7):
        split = ChatRound(None)
        out = b"".join(split.feed(wire[i:i + size]) for i in range(0, len(wire), size))
        assert out + split.end() == expected
        calls = split.reply()["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather", TOOL_NAME]
    assert b"get_weather" in expected and TOOL_NAME.encode() not in expected
    assert expected.endswith(b"data: [DONE]\n\n")
