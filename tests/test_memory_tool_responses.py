"""Memory as a tool in OpenAI's Responses API, whole and streamed, through the official openai
SDK and the scripted upstream scripted to call memory_search."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import openai
import pytest
from openai.types.responses import FunctionToolParam, Response

from proxy.flow.memory_tool.dialect import TOOL_NAME
from tests.conftest import RunningProxy
from tests.support.formats import response_events, response_object
from tests.support.scripted_upstream import JSONReply, Received, Reply, ScriptedUpstream, SSEReply
from tests.test_memory_tool import NOTE, QUESTION, remember_note, stored_turns

SEARCH = {"type": "function_call", "name": TOOL_NAME, "arguments": '{"query": "billing database"}'}
WEATHER = {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Lisbon"}'}
WEATHER_TOOL: FunctionToolParam = {
    "type": "function", "name": "get_weather", "strict": False,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def reply(items: Sequence[Mapping[str, Any]], *, input_tokens: int = 10, stream: bool = False) -> Reply:
    """A response whose output is `items` (`{"type": "text", "text"}` or function calls),
    whole or as its events."""
    text = "".join(i["text"] for i in items if i["type"] == "text") or None
    calls = [{"name": i["name"], "arguments": i["arguments"]} for i in items if i["type"] != "text"]
    if stream:
        return SSEReply(response_events(text, function_calls=calls, input_tokens=input_tokens),
                        done=False)
    return JSONReply(response_object(text, function_calls=calls, input_tokens=input_tokens))


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], Response]:
    """The events the SDK's stream helper read, and the response it put together."""
    with client.responses.stream(model="gpt-4o", **kwargs) as events:
        return list(events), events.get_final_response()


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    proxy = start_proxy(memory=True, memory_tool_prefetch=0)
    remember_note(proxy)
    return proxy


@pytest.fixture
def client(memproxy: RunningProxy) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=memproxy.base_url, api_key="sk-test", max_retries=0, timeout=60,
                       default_headers={"X-Memory-Mode": "tool", "X-Memory-Session-Id": "now"}) as sdk:
        yield sdk


def sent(upstream: ScriptedUpstream) -> list[Received]:
    return [r for r in upstream.history if r.path == "/v1/responses"]


def answered_and_continued(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream, final: Response
) -> None:
    """The client got the second round's answer (usage summed over both rounds), memory
    stored it, and the client continues from that response, whose context holds the answer."""
    assert final.output_text == "It is Postgres 16." and final.usage is not None
    assert final.usage.input_tokens == 10 + 30
    assert stored_turns(memproxy) == [("user", QUESTION), ("assistant", "It is Postgres 16.")]
    client.responses.create(model="gpt-4o", input="Thanks!", previous_response_id=final.id)
    assert sent(upstream)[-1].json["previous_response_id"] == final.id


def test_memory_search_is_answered_and_the_client_gets_the_last_response(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(reply([{"type": "text", "text": "Let me check. "}, SEARCH]),
                     reply([{"type": "text", "text": "It is Postgres 16."}], input_tokens=30),
                     path="/v1/responses")
    raw = client.responses.with_raw_response.create(model="gpt-4o", input=QUESTION)
    final = raw.parse()
    first, second = sent(upstream)
    assert [t["name"] for t in first.json["tools"]] == [TOOL_NAME]
    said, called, answered = second.json["input"][-3:]
    assert said["type"] == "message" and called["name"] == TOOL_NAME
    assert answered["type"] == "function_call_output" and answered["call_id"] == called["call_id"]
    assert NOTE in answered["output"]
    assert raw.headers["x-memory-tool-searches"] == "1"
    answered_and_continued(memproxy, client, upstream, final)


def test_client_function_calls_pass_and_a_searching_turn_withholds_them(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(reply([WEATHER, SEARCH]), reply([WEATHER]), path="/v1/responses")
    final = client.responses.create(model="gpt-4o", input="Weather where the billing team sits?",
                                    tools=[WEATHER_TOOL])
    calls = [(item.name, item.arguments) for item in final.output if item.type == "function_call"]
    assert calls == [("get_weather", '{"city": "Lisbon"}')]
    first, second = sent(upstream)
    assert [t["name"] for t in first.json["tools"]] == ["get_weather", TOOL_NAME]
    called = [i.get("name") for i in second.json["input"] if i.get("type") == "function_call"]
    assert called == [TOOL_NAME]


def test_the_last_round_keeps_the_definition_but_forbids_the_call(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, memory_mode="tool", memory_tool_rounds=1)
    upstream.respond_with(lambda r: reply([SEARCH]) if r.path == "/v1/responses" else None)
    with openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0) as sdk:
        final = sdk.responses.create(model="gpt-4o", input=QUESTION)
    assert final.output == []
    first, last = sent(upstream)
    assert "tool_choice" not in first.json and last.json["tool_choice"] == "none"
    assert [t["name"] for t in last.json["tools"]] == [TOOL_NAME]


def test_a_streamed_search_round_is_held_back_and_the_client_streams_the_last(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(reply([SEARCH], stream=True),
                     reply([{"type": "text", "text": "It is Postgres 16."}], input_tokens=30, stream=True),
                     path="/v1/responses")
    seen, final = streamed(client, input=QUESTION)
    first, second = sent(upstream)
    assert first.json["stream"] is True and [t["name"] for t in first.json["tools"]] == [TOOL_NAME]
    answered = second.json["input"][-1]
    assert answered["type"] == "function_call_output" and NOTE in answered["output"]
    # One response, the last round's: one created event, numbered without gaps.
    assert [e.type for e in seen].count("response.created") == 1
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert {e.response.id for e in seen if hasattr(e, "response")} == {final.id}
    assert [item.type for item in final.output] == ["message"]
    answered_and_continued(memproxy, client, upstream, final)


def test_a_search_after_streamed_text_is_dropped_and_the_rest_numbered_on(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(reply([{"type": "text", "text": "Postgres, I think."}, SEARCH, WEATHER],
                           stream=True), path="/v1/responses")
    seen, final = streamed(client, input=QUESTION, tools=[WEATHER_TOOL])
    assert len(sent(upstream)) == 1  # the answer had begun: no second round
    assert final.output_text == "Postgres, I think."
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [
        ("message", None), ("function_call", "get_weather")]
    indexes = {e.output_index for e in seen if hasattr(e, "output_index")}
    assert indexes == {0, 1}
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    named = [getattr(getattr(e, "item", None), "name", None) for e in seen]
    assert "get_weather" in named and TOOL_NAME not in named


def test_a_streamed_client_call_goes_out_and_the_mode_header_says_tool(
    memproxy: RunningProxy, client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(reply([WEATHER], stream=True), path="/v1/responses")
    with client.responses.with_streaming_response.create(
        model="gpt-4o", input="Weather in Lisbon?", tools=[WEATHER_TOOL], stream=True,
    ) as streamed:
        assert streamed.headers["x-memory-mode"] == "tool"
        body = streamed.read()
    assert body.count(b"event: response.created") == 1 and b'"get_weather"' in body
    assert TOOL_NAME.encode() not in body
    (sent_,) = sent(upstream)
    assert [t["name"] for t in sent_.json["tools"]] == ["get_weather", TOOL_NAME]
