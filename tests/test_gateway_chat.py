"""Chat completions through memproxy with memory off: the wire is unchanged both ways."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import RunningProxy
from tests.support.scripted_upstream import (
    JSONReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)

# Plain dicts as a client builds them; Any so the SDK's TypedDict overloads accept them.
MESSAGES: Any = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there", "name": "ada"},
]
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]


def sdk(proxy: RunningProxy, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0, **kwargs)


def test_request_bytes_reach_the_upstream_unchanged(
    proxy: RunningProxy, upstream: ScriptedUpstream, client: httpx.Client
) -> None:
    body = orjson.dumps({
        "model": "gpt-4o-mini", "messages": MESSAGES, "temperature": 0.2, "seed": 7,
        "response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 2,
        "tools": TOOLS, "n": 2, "some_future_field": {"nested": [1, 2, 3]},
    })
    response = client.post("/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert upstream.history[-1].body == body
    assert response.headers["x-memory-session-id"].startswith("fp-")


def test_sdk_non_streaming_round_trip(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    reply = chat_completion("Hello!", tool_calls=[{"name": "get_weather", "arguments": '{"city":"Oslo"}'}],
                            n=2, logprobs=True)
    upstream.enqueue(JSONReply(reply))
    completion = sdk(proxy).chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS, n=2, logprobs=True,
        response_format={"type": "text"}, extra_body={"unknown_knob": True},
    )
    sent = upstream.history[-1].json
    assert sent["messages"] == MESSAGES and sent["tools"] == TOOLS and sent["n"] == 2
    assert sent["unknown_knob"] is True and sent["response_format"] == {"type": "text"}
    assert completion.model_dump(exclude_unset=True) == reply


def test_sdk_streaming_chunk_for_chunk(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    chunks = chat_chunks("The quick brown fox", split=4, include_usage=True)
    upstream.enqueue(SSEReply(chunks))
    stream = sdk(proxy).chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True},
    )
    received = [chunk.model_dump(exclude_unset=True) for chunk in stream]
    assert received == chunks
    assert upstream.history[-1].json["stream_options"] == {"include_usage": True}


def test_raw_stream_bytes_are_relayed_untouched(
    proxy: RunningProxy, upstream: ScriptedUpstream, client: httpx.Client
) -> None:
    events = [": comment\n\n", *chat_chunks("a b c", split=3), "data: {\"odd\":  true}\r\n\r\n"]
    upstream.enqueue(SSEReply(events))
    direct = b""
    with httpx.stream("POST", f"{upstream.base_url}/chat/completions",
                      json={"model": "m", "messages": MESSAGES, "stream": True}) as r:
        for part in r.iter_raw():
            direct += part
    upstream.enqueue(SSEReply(events))
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "m", "messages": MESSAGES, "stream": True}) as r:
        relayed = b"".join(r.iter_raw())
        assert r.headers["content-type"].startswith("text/event-stream")
    # ids and timestamps differ per reply; everything else is byte-for-byte the same.
    assert _strip_ids(relayed) == _strip_ids(direct)


def _strip_ids(data: bytes) -> bytes:
    import re

    return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", data)


async def test_async_sdk_streaming_and_not(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    upstream.enqueue(JSONReply(chat_completion("one")), SSEReply(chat_chunks("two parts", split=2)))
    first = await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert first.choices[0].message.content == "one"
    assert text == "two parts"
    await client.close()


async def test_concurrent_streams(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"number {i}"}], stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(20)))
    assert texts == [f"echo: number {i}" for i in range(20)]
    await client.close()


def test_other_endpoints_through_the_sdk(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    client = sdk(proxy)
    assert [m.id for m in client.models.list()]
    vectors = client.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert len(vectors.data) == 2
    completion = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Say hi")
    assert completion.choices[0].text
    paths = [(r.method, r.path) for r in upstream.history]
    assert paths == [("GET", "/v1/models"), ("POST", "/v1/embeddings"), ("POST", "/v1/completions")]


def test_any_v1_path_method_query_and_body_pass_through(
    proxy: RunningProxy, upstream: ScriptedUpstream, client: httpx.Client
) -> None:
    upload = b"\x00\x01binary" * 5000
    response = client.post(
        "/v1/files?purpose=fine-tune&x=1", files={"file": ("data.jsonl", upload)},
        headers={"OpenAI-Beta": "assistants=v2", "X-Memory": "off"},
    )
    assert response.status_code == 200
    seen = upstream.history[-1]
    assert (seen.method, seen.path, seen.query) == ("POST", "/v1/files", "purpose=fine-tune&x=1")
    assert upload in seen.body and seen.headers["openai-beta"] == "assistants=v2"
    assert "x-memory" not in seen.headers
    client.delete("/v1/files/file-123")
    assert (upstream.history[-1].method, upstream.history[-1].path) == ("DELETE", "/v1/files/file-123")


def test_binary_response_streams_back(
    proxy: RunningProxy, upstream: ScriptedUpstream, client: httpx.Client
) -> None:
    from tests.support.scripted_upstream import RawReply

    audio = bytes(range(256)) * 4096
    upstream.enqueue(RawReply(audio, content_type="audio/mpeg", chunk_size=65536))
    response = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "x"})
    assert response.content == audio
    assert response.headers["content-type"] == "audio/mpeg"


@pytest.mark.parametrize("header", ["x-memory-session-id"])
def test_session_header_on_every_chat_response(
    proxy: RunningProxy, client: httpx.Client, header: str
) -> None:
    plain = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    named = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                        headers={"X-Memory-Session-Id": "s-42"})
    again = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert named.headers[header] == "s-42"
    assert plain.headers[header] == again.headers[header] != "s-42"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_carry_one_date_header(client: httpx.Client, stream: bool) -> None:
    """The upstream's Date is not relayed next to the one memproxy's server writes."""
    for path, body in (("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stream": stream}),
                       ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "hi"})):
        response = client.post(path, json=body)
        assert response.status_code == 200
        assert len(response.headers.get_list("date")) == 1, path


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(after: str, fence: str) -> str:
    """The first code block of the README's front page after the line `after`."""
    return README.read_text().split(after + "\n", 1)[1].split(f"```{fence}\n", 1)[1].split("```", 1)[0]


def test_the_readme_chat_example_runs(
    proxy: RunningProxy, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = readme_block("**OpenAI SDK** (chat completions):", "python")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # the example passes its own key
    namespace: dict[str, Any] = {}
    exec(example.replace("http://127.0.0.1:8080/v1", proxy.base_url), namespace)
    namespace["client"].close()  # its pooled socket, else closed by the garbage collector
    assert capsys.readouterr().out == "echo: Where do I live?\n"
    assert upstream.history[-1].path == "/v1/chat/completions"
    assert upstream.history[-1].headers["authorization"] == "Bearer sk-..."


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's example needs curl")
def test_the_readme_curl_example_runs(proxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    example = readme_block("**curl**:", "sh")
    done = subprocess.run(
        ["bash", "-c", example.replace("http://127.0.0.1:8080", proxy.url).rstrip() + " --silent --fail"],
        env={**os.environ, "OPENAI_API_KEY": "sk-readme"}, capture_output=True, timeout=60, check=True,
    )
    assert orjson.loads(done.stdout)["choices"][0]["message"]["content"] == "echo: Where do I live?"
    assert upstream.history[-1].json["messages"] == [{"role": "user", "content": "Where do I live?"}]
    assert upstream.history[-1].headers["authorization"] == "Bearer sk-readme"
