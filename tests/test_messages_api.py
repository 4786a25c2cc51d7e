"""POST /v1/messages (Anthropic's Messages API) with memory, through the official anthropic SDK."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from memory.recall.render import OPEN
from tests.conftest import RunningProxy
from tests.support.formats import anthropic_error, message_events
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream, SSEReply
from tests.support.sql import query

pytestmark = pytest.mark.both_backends

ADA = {"X-Memory-User-Id": "ada"}
MODEL = "claude-scripted-1"


def origin(upstream: ScriptedUpstream) -> str:
    return upstream.base_url.removesuffix("/v1")


Claude = Callable[..., anthropic.Anthropic]


@pytest.fixture
def claude() -> Iterator[Claude]:
    """Make anthropic clients aimed at a proxy: claude(proxy, key=..., **headers)."""
    made: list[anthropic.Anthropic] = []

    def make(proxy: RunningProxy, key: str = "sk-ant-client", **headers: str) -> anthropic.Anthropic:
        made.append(anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0,
                                        default_headers=headers))
        return made[-1]

    yield make
    for client in made:
        client.close()


def turns(proxy: RunningProxy, user: str = "ada") -> list[tuple[str, str, int]]:
    return query(proxy.state.settings, "SELECT role, content, incomplete FROM turns"
                 " WHERE user_id = ? ORDER BY id", (user,))


@pytest.fixture
def direct(start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream) -> RunningProxy:
    """memproxy with memory, relaying /v1/messages to an Anthropic-compatible upstream."""
    return start_proxy(memory=True, anthropic_base_url=origin(upstream))


def say_fact(claude: Claude, proxy: RunningProxy) -> None:
    claude(proxy, **ADA).messages.create(model=MODEL, max_tokens=100, messages=[
        {"role": "user", "content": "The billing service runs on Postgres 16 with pgvector."}])
    wait_for_jobs(proxy)


def test_create_relays_bytes_and_the_clients_key(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, claude: Claude
) -> None:
    proxy = start_proxy(anthropic_base_url=origin(upstream) + "/v1/")
    message = claude(proxy).messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert message.content[0].type == "text" and message.content[0].text == "echo: hi"
    sent = upstream.history[-1]
    # anthropic-python 2.x sends its key as a Bearer token; Claude Code as x-api-key.
    assert sent.path == "/v1/messages" and sent.headers["authorization"] == "Bearer sk-ant-client"
    assert sent.headers["anthropic-version"]
    assert sent.json["messages"][0]["content"][1]["type"] == "image"
    raw = b'{"model": "claude-scripted-1", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}'
    httpx.post(f"{proxy.url}/v1/messages", content=raw, timeout=20, headers={
        "x-api-key": "sk-ant-raw", "anthropic-version": "2023-06-01", "anthropic-beta": "b1"})
    sent = upstream.history[-1]
    assert sent.body == raw and sent.headers["x-api-key"] == "sk-ant-raw"
    assert sent.headers["anthropic-beta"] == "b1"


def test_a_configured_key_replaces_the_clients(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, claude: Claude
) -> None:
    proxy = start_proxy(anthropic_base_url=origin(upstream), anthropic_api_key="sk-ant-conf")
    claude(proxy).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    sent = upstream.history[-1].headers
    assert sent["x-api-key"] == "sk-ant-conf" and "authorization" not in sent


def test_stream_is_relayed_byte_for_byte_and_remembered(
    direct: RunningProxy, upstream: ScriptedUpstream, claude: Claude
) -> None:
    events = message_events("Hello from the stream", split=4)
    upstream.enqueue(SSEReply(events, done=False), path="/v1/messages")
    with httpx.stream("POST", f"{direct.url}/v1/messages", headers=ADA, timeout=20, json={
        "model": MODEL, "max_tokens": 50, "stream": True,
        "messages": [{"role": "user", "content": "greet me"}],
    }) as reply:
        body = b"".join(reply.iter_raw())
    assert body == b"".join(events)
    with claude(direct, **ADA).messages.stream(model=MODEL, max_tokens=50, messages=[
            {"role": "user", "content": "and again"}]) as stream:
        text = "".join(stream.text_stream)
    assert text == "echo: and again"
    wait_for_jobs(direct)
    assert turns(direct) == [("user", "greet me", 0), ("assistant", "Hello from the stream", 0),
                             ("user", "and again", 0), ("assistant", "echo: and again", 0)]


def test_tool_use_and_results_are_remembered_as_text(
    direct: RunningProxy, upstream: ScriptedUpstream, claude: Claude
) -> None:
    claude(direct, **ADA).messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "-3 C"}]},
    ])
    wait_for_jobs(direct)
    assert turns(direct)[:3] == [("user", "weather in Oslo?", 0),
                                 ("assistant", '[tool call] weather({"city":"Oslo"})', 0),
                                 ("tool", "-3 C", 0)]


def test_memory_goes_at_the_end_of_system_string_or_blocks(
    direct: RunningProxy, upstream: ScriptedUpstream, claude: Claude
) -> None:
    say_fact(claude, direct)
    client = claude(direct, **ADA)
    question: Any = [{"role": "user", "content": "Which database does billing use?"}]
    client.messages.create(model=MODEL, max_tokens=50, system="Be brief.", messages=question)
    system = upstream.history[-1].json["system"]
    assert system.startswith(f"Be brief.\n\n{OPEN}") and "Postgres 16 with pgvector" in system
    cached: Any = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    client.messages.create(model=MODEL, max_tokens=50, system=cached, messages=question)
    sent = upstream.history[-1].json
    assert sent["system"][0] == cached[0] and sent["system"][1]["text"].startswith(OPEN)
    assert sent["messages"] == question


def test_memory_goes_after_the_last_breakpoint_in_the_messages(
    direct: RunningProxy, upstream: ScriptedUpstream, claude: Claude
) -> None:
    say_fact(claude, direct)
    marked = {"type": "text", "text": "Long shared context.", "cache_control": {"type": "ephemeral"}}
    messages: list[Any] = [
        {"role": "user", "content": [marked, {"type": "text", "text": "Which database does billing use?"}]},
    ]
    claude(direct, **ADA).messages.create(model=MODEL, max_tokens=50, system="Be brief.",
                                          messages=messages)
    sent = upstream.history[-1].json
    assert sent["system"] == "Be brief."  # the cached prefix stays byte-identical
    blocks = sent["messages"][0]["content"]
    assert blocks[0] == marked and blocks[1]["text"].startswith(OPEN) and blocks[2] == messages[0]["content"][1]


def test_last_user_placement_goes_after_tool_results(
    direct: RunningProxy, upstream: ScriptedUpstream, claude: Claude
) -> None:
    say_fact(claude, direct)
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}
    messages: list[Any] = [
        {"role": "user", "content": "check billing"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "db", "input": {}}]},
        {"role": "user", "content": [result, {"type": "text", "text": "Which database does billing use?"}]},
    ]
    for injection in ("fresh", "stable"):
        claude(direct, **ADA, **{"X-Memory-Placement": "last_user", "X-Memory-Injection": injection}
               ).messages.create(model=MODEL, max_tokens=50, system="Be brief.", messages=messages)
        sent = upstream.history[-1].json
        assert sent["system"] == "Be brief." and sent["messages"][:2] == messages[:2]
        last = sent["messages"][2]["content"]
        assert last[0] == result and "Postgres 16 with pgvector" in last[1]["text"]
        assert last[2] == messages[2]["content"][1]


def test_a_fact_said_through_one_api_is_recalled_through_the_others(
    direct: RunningProxy, upstream: ScriptedUpstream, claude: Claude
) -> None:
    oa = openai.OpenAI(base_url=direct.base_url, api_key="sk-test", max_retries=0,
                       default_headers=ADA)
    try:
        _say_and_recall(claude, direct, upstream, oa)
    finally:
        oa.close()


def _say_and_recall(
    claude: Claude, direct: RunningProxy, upstream: ScriptedUpstream, oa: openai.OpenAI
) -> None:
    claude(direct, **ADA).messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "My sister Ines lives in Porto and teaches violin."}])
    oa.responses.create(model="gpt-4o-mini", input="Our staging cluster is named kestrel-7.")
    oa.chat.completions.create(model="gpt-4o", messages=[
        {"role": "user", "content": "I always deploy on Thursdays at 10am."}])
    wait_for_jobs(direct)
    oa.chat.completions.create(model="gpt-4o", messages=[
        {"role": "user", "content": "Where does my sister Ines live?"}])
    assert "Porto" in upstream.history[-1].json["messages"][0]["content"]
    claude(direct, **ADA).messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "What is the staging cluster called?"}])
    assert "kestrel-7" in upstream.history[-1].json["system"]
    oa.responses.create(model="gpt-4o-mini", input="Which day do I deploy on?")
    assert "Thursdays at 10am" in upstream.history[-1].json["instructions"]


@pytest.mark.parametrize(("body", "param"), [
    (b"{nope", None),
    (b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
    (b'{"model": "m", "max_tokens": true, "messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
    (b'{"model": "m", "max_tokens": 5, "messages": []}', "messages"),
    (b'{"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}', "messages.0.role"),
    (b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}', "messages.0.content"),
    (b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]}', "messages.0.content.0"),
    (b'{"model": "m", "max_tokens": 5, "system": 3, "messages": [{"role": "user", "content": "x"}]}', "system"),
])
def test_malformed_bodies_get_anthropics_400_and_nothing_is_stored(
    direct: RunningProxy, upstream: ScriptedUpstream, body: bytes, param: str | None, claude: Claude
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(direct, **ADA).post("/v1/messages", content=body, cast_to=httpx.Response,
                                   options={"headers": {"content-type": "application/json"}})
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": caught.value.body["error"]["message"]}}  # type: ignore[index]
    assert param is None or param in caught.value.message
    assert upstream.history == [] and turns(direct) == []


def test_errors_before_and_during_a_stream_use_anthropics_envelope(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, claude: Claude
) -> None:
    proxy = start_proxy(anthropic_base_url=origin(upstream), api_keys="pk-12345678")
    client = claude(proxy, key="pk-12345678")
    with pytest.raises(anthropic.AuthenticationError) as denied:
        claude(proxy, key="wrong").messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": "x"}])
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    overloaded = anthropic_error("Overloaded", "overloaded_error")
    upstream.enqueue(JSONReply(overloaded, status=529), path="/v1/messages")
    with pytest.raises(anthropic.APIStatusError) as busy:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert busy.value.status_code == 529 and busy.value.body == overloaded
    sent = upstream.history[-1].headers  # the proxy key stays here
    assert "x-api-key" not in sent and "authorization" not in sent
    upstream.enqueue(SSEReply(message_events("one two three four", split=4), cut_after=4, delay=0.05))
    with pytest.raises(anthropic.APIStatusError) as cut:
        with client.messages.stream(model=MODEL, max_tokens=50,
                                    messages=[{"role": "user", "content": "count"}]) as stream:
            for _ in stream:
                pass
    assert cut.value.body["type"] == "error" and cut.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_without_an_anthropic_upstream_litellm_translates_to_chat_completions(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, claude: Claude
) -> None:
    proxy = start_proxy(memory=True)
    client = claude(proxy, **ADA)
    message = client.messages.create(model="gpt-4o", max_tokens=50, system="Be brief.",
                                     messages=[{"role": "user", "content": "I collect vinyl records."}])
    assert message.content[0].type == "text" and message.content[0].text == "echo: I collect vinyl records."
    sent = upstream.history[-1]
    assert sent.path == "/v1/chat/completions" and sent.headers["authorization"] == "Bearer sk-ant-client"
    assert sent.json["messages"][0] == {"role": "system", "content": "Be brief."}
    with client.messages.stream(model="gpt-4o", max_tokens=50, messages=[
            {"role": "user", "content": "stream it"}]) as stream:
        assert "".join(stream.text_stream) == "echo: stream it"
    wait_for_jobs(proxy)
    assert [content for _, content, _ in turns(proxy)] == [
        "I collect vinyl records.", "echo: I collect vinyl records.", "stream it", "echo: stream it"]


def test_count_tokens_passes_through_or_is_estimated(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, claude: Claude
) -> None:
    messages: Any = [{"role": "user", "content": "How many tokens is this sentence?"}]
    relayed = claude(start_proxy(anthropic_base_url=origin(upstream))).messages.count_tokens(
        model=MODEL, messages=messages)
    assert upstream.history[-1].path == "/v1/messages/count_tokens" and relayed.input_tokens > 0
    upstream.clear()
    estimated = claude(start_proxy()).messages.count_tokens(model=MODEL, messages=messages)
    assert 5 <= estimated.input_tokens <= 12 and upstream.history == []


def test_the_readme_python_example_runs(
    direct: RunningProxy, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("**Anthropic Messages**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-readme")
    namespace: dict[str, Any] = {}
    exec(example.replace("http://127.0.0.1:8080", direct.url), namespace)
    namespace["client"].close()  # its pooled connection, not left to the garbage collector
    assert capsys.readouterr().out == "echo: Where do I live?\n"
    assert upstream.history[-1].path == "/v1/messages"
