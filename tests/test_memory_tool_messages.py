"""Memory as a tool in Anthropic Messages, through the official anthropic SDK: memproxy relays
/v1/messages to the scripted upstream, which is scripted to call memory_search."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import MessageParam, ToolParam

from proxy.flow.memory_tool.dialect import TOOL_NAME
from tests.conftest import RunningProxy
from tests.support.formats import message_object, named_event
from tests.support.scripted_upstream import JSONReply, Received, Reply, ScriptedUpstream, SSEReply
from tests.test_memory_tool import NOTE, QUESTION, remember_note, stored_turns

MODEL = "claude-scripted-1"
SEARCH = {"type": "tool_use", "name": TOOL_NAME, "input": {"query": "billing service database"}}
WEATHER = {"type": "tool_use", "name": "get_weather", "input": {"city": "Lisbon"}}
WEATHER_TOOL: ToolParam = {"name": "get_weather", "description": "Weather in a city.",
                           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def message_stream(blocks: Sequence[Mapping[str, Any]], *, input_tokens: int = 10) -> list[bytes]:
    """A streamed Messages reply of text and tool_use blocks (`{"type": "text", "text"}`,
    `{"type": "tool_use", "name", "input"}`), stopping for tool use when it has one."""
    uses = any(b["type"] == "tool_use" for b in blocks)
    start = {**message_object("", input_tokens=input_tokens), "content": [], "stop_reason": None,
             "usage": {"input_tokens": input_tokens, "output_tokens": 1}}
    payloads: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for i, block in enumerate(blocks):
        opened: dict[str, Any]
        if block["type"] == "text":
            opened, deltas = {"type": "text", "text": ""}, [
                {"type": "text_delta", "text": block["text"]}]
        else:
            opened = {"type": "tool_use", "id": f"toolu_{i}_{os.urandom(4).hex()}",
                      "name": block["name"], "input": {}}
            arguments = json.dumps(block["input"])
            deltas = [{"type": "input_json_delta", "partial_json": part}
                      for part in (arguments[:5], arguments[5:])]
        payloads += [{"type": "content_block_start", "index": i, "content_block": opened},
                     *({"type": "content_block_delta", "index": i, "delta": d} for d in deltas),
                     {"type": "content_block_stop", "index": i}]
    payloads += [{"type": "message_delta", "usage": {"output_tokens": 5},
                  "delta": {"stop_reason": "tool_use" if uses else "end_turn", "stop_sequence": None}},
                 {"type": "message_stop"}]
    return [named_event(p["type"], p) for p in payloads]


def reply(blocks: Sequence[Mapping[str, Any]], *, stream: bool, input_tokens: int = 10) -> Reply:
    if stream:
        return SSEReply(message_stream(blocks, input_tokens=input_tokens), done=False)
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    uses = [b for b in blocks if b["type"] == "tool_use"]
    return JSONReply(message_object(text, tool_uses=uses, input_tokens=input_tokens,
                                    stop_reason="tool_use" if uses else "end_turn"))


@pytest.fixture
def direct(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> RunningProxy:
    proxy = start_proxy(memory=True, memory_tool_prefetch=0,
                        anthropic_base_url=upstream.base_url.removesuffix("/v1"))
    remember_note(proxy)
    return proxy


@pytest.fixture
def claude(direct: RunningProxy) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=direct.url, api_key="sk-ant", max_retries=0, default_headers={
            "X-Memory-Mode": "tool", "X-Memory-Session-Id": "now"}) as client:
        yield client


def sent(upstream: ScriptedUpstream) -> list[Received]:
    return [r for r in upstream.history if r.path == "/v1/messages"]


def ask(claude: anthropic.Anthropic, content: str, *, stream: bool,
        tools: Sequence[ToolParam] = ()) -> anthropic.types.Message:
    messages: list[MessageParam] = [{"role": "user", "content": content}]
    if not stream:
        return claude.messages.create(model=MODEL, max_tokens=100, messages=messages, tools=tools)
    with claude.messages.stream(model=MODEL, max_tokens=100, messages=messages, tools=tools) as events:
        return events.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_memory_search_is_answered_and_the_client_gets_one_message(
    direct: RunningProxy, claude: anthropic.Anthropic, upstream: ScriptedUpstream, stream: bool
) -> None:
    upstream.enqueue(reply([{"type": "text", "text": "Let me check. "}, SEARCH], stream=stream),
                     reply([{"type": "text", "text": "It is Postgres 16."}], stream=stream,
                           input_tokens=30), path="/v1/messages")
    message = ask(claude, QUESTION, stream=stream)
    first, second = sent(upstream)
    assert [t["name"] for t in first.json["tools"]] == [TOOL_NAME]
    assert first.json["tools"][0]["input_schema"]["required"] == ["query"]
    asked, answered = second.json["messages"][-2:]
    assert [b["type"] for b in asked["content"]] == ["text", "tool_use"]
    (result,) = answered["content"]
    assert result["type"] == "tool_result" and result["tool_use_id"] == asked["content"][1]["id"]
    assert NOTE in result["content"]
    texts = [b.text for b in message.content if b.type == "text"]
    # A stream shows both rounds' text; a whole reply is the last round's message.
    assert texts == (["Let me check. ", "It is Postgres 16."] if stream else ["It is Postgres 16."])
    assert all(b.type == "text" for b in message.content)
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 10 + 30
    assert stored_turns(direct) == [("user", QUESTION), ("assistant", "".join(texts))]


@pytest.mark.parametrize("stream", [False, True])
def test_client_tool_uses_pass_and_a_searching_turn_withholds_them(
    direct: RunningProxy, claude: anthropic.Anthropic, upstream: ScriptedUpstream, stream: bool
) -> None:
    upstream.enqueue(reply([WEATHER, SEARCH], stream=stream), reply([WEATHER], stream=stream),
                     path="/v1/messages")
    message = ask(claude, "Weather where the billing team sits?", stream=stream, tools=[WEATHER_TOOL])
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Lisbon"})]
    assert message.stop_reason == "tool_use"
    first, second = sent(upstream)
    assert [t["name"] for t in first.json["tools"]] == ["get_weather", TOOL_NAME]
    assert [b.get("name") for b in second.json["messages"][-2]["content"]] == [TOOL_NAME]


def test_the_last_round_keeps_the_definition_but_forbids_the_call(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, memory_mode="tool", memory_tool_rounds=1,
                        anthropic_base_url=upstream.base_url.removesuffix("/v1"))
    upstream.respond_with(lambda r: reply([SEARCH], stream=True) if r.path == "/v1/messages" else None)
    with anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0) as client:
        message = ask(client, QUESTION, stream=True)
    assert message.content == [] and message.stop_reason == "end_turn"
    first, last = sent(upstream)
    assert "tool_choice" not in first.json and last.json["tool_choice"] == {"type": "none"}
    assert [t["name"] for t in last.json["tools"]] == [TOOL_NAME]


def test_the_stream_is_one_message_with_blocks_numbered_on(
    direct: RunningProxy, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(reply([{"type": "text", "text": "Let me check. "}, SEARCH], stream=True),
                     reply([{"type": "text", "text": "Found it."}, WEATHER], stream=True),
                     path="/v1/messages")
    with httpx.stream("POST", f"{direct.url}/v1/messages", timeout=60, headers={
        "X-Memory-Mode": "tool", "anthropic-version": "2023-06-01",
    }, json={"model": MODEL, "max_tokens": 50, "stream": True, "tools": [WEATHER_TOOL],
             "messages": [{"role": "user", "content": QUESTION}]}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    starts = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]
    assert starts == [(0, "text"), (1, "text"), (2, "tool_use")]
    kinds = [e["type"] for e in events]
    assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
    assert kinds.count("message_delta") == 1 and kinds.count("message_stop") == 1
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] == 10
