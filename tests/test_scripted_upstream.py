"""The scripted upstream, driven by the clients the project's tests use: httpx and openai."""

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.scripted_upstream import (
    Drop,
    ErrorReply,
    Hang,
    JSONReply,
    RawReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
    fake_embedding,
)

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        yield up


@pytest.fixture
def up(server: ScriptedUpstream) -> ScriptedUpstream:
    server.clear()
    return server


@pytest.fixture
def client(up: ScriptedUpstream) -> Iterator[openai.OpenAI]:
    # The SDK retries 408/409/429/5xx and dropped connections twice by default, which
    # would consume default replies after the scripted one.
    with openai.OpenAI(base_url=up.base_url, api_key="sk-test", max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def http(up: ScriptedUpstream) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=up.base_url, timeout=5) as c:
        yield c


def test_default_chat_completion_echoes_the_last_user_message(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="gpt-4o", messages=HELLO, n=2)
    assert [c.message.content for c in reply.choices] == ["echo: hello", "echo: hello"]
    assert reply.model == "gpt-4o" and reply.usage is not None


def test_default_stream_parses_through_the_sdk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m", messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: hello"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_default_models_embeddings_and_completions(client: openai.OpenAI) -> None:
    assert "gpt-4o-mini" in [m.id for m in client.models.list()]
    vectors = client.embeddings.create(model="e", input=["a", "b"]).data  # SDK asks for base64
    assert vectors[0].embedding == pytest.approx(fake_embedding("a"), abs=1e-6)
    assert client.completions.create(model="i", prompt="hi").choices[0].text == "echo: hi"


def test_other_paths_echo_the_request(http: httpx.Client) -> None:
    reply = http.post("/files?purpose=x", content=b"abc", headers={"content-type": "text/plain"})
    assert reply.json() == {"method": "POST", "path": "/v1/files", "query": "purpose=x",
                            "body_length": 3, "content_type": "text/plain"}


def test_queue_is_fifo_and_a_path_queue_goes_first(up: ScriptedUpstream, http: httpx.Client) -> None:
    up.enqueue(JSONReply({"n": 1}), {"n": 2})
    up.enqueue(JSONReply({"n": "models"}), path="/v1/models")
    assert http.get("/models").json() == {"n": "models"}
    assert [http.get("/anything").json()["n"] for _ in range(2)] == [1, 2]
    assert http.get("/anything").json()["path"] == "/v1/anything"
    assert up.pending == 0


def test_history_records_requests(up: ScriptedUpstream, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="m", messages=HELLO, extra_headers={"X-Trace": "t1"})
    [seen] = up.history
    assert (seen.method, seen.path, seen.headers["x-trace"]) == ("POST", "/v1/chat/completions", "t1")
    assert seen.json["messages"] == HELLO and b'"hello"' in seen.body
    assert up.wait_for(1) == [seen]


def test_builders_parse_through_the_sdk(up: ScriptedUpstream, client: openai.OpenAI) -> None:
    call = {"name": "weather", "arguments": {"city": "Paris"}}
    up.enqueue(chat_completion(None, tool_calls=[call], logprobs=True))
    up.enqueue(SSEReply(chat_chunks("Bonjour", tool_calls=[call], include_usage=True)))
    message = client.chat.completions.create(model="m", messages=HELLO).choices[0].message
    assert message.tool_calls[0].function.arguments == '{"city":"Paris"}'  # type: ignore[index,union-attr]
    chunks = list(client.chat.completions.create(model="m", messages=HELLO, stream=True))
    arguments = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""  # type: ignore[union-attr]
        for c in chunks if c.choices and c.choices[0].delta.tool_calls
    )
    assert arguments == '{"city":"Paris"}' and chunks[-2].choices[0].finish_reason == "tool_calls"


def test_cut_after_breaks_the_body(up: ScriptedUpstream, http: httpx.Client, client: openai.OpenAI) -> None:
    up.enqueue(SSEReply(chat_chunks("Hello world"), cut_after=2))
    received: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError), http.stream("POST", "/chat/completions") as reply:
        received.extend(reply.iter_lines())
    assert sum(line.startswith("data: ") for line in received) == 2
    up.enqueue(SSEReply(chat_chunks("Hello world"), cut_after=1))
    with pytest.raises((httpx.RemoteProtocolError, openai.APIError)):
        list(client.chat.completions.create(model="m", messages=HELLO, stream=True))


def test_raw_events_and_bodies_go_out_as_written(up: ScriptedUpstream, http: httpx.Client) -> None:
    up.enqueue(SSEReply(['event: error\ndata: {"error": {"message": "boom"}}\n\n', b"data: {\"a\""], done=False))
    assert http.post("/chat/completions").text == 'event: error\ndata: {"error": {"message": "boom"}}\n\ndata: {"a"'
    blob = bytes(range(256)) * 4096
    up.enqueue(RawReply(b"{not json", content_type="application/json"), RawReply(blob, chunk_size=65536))
    assert http.get("/x").content == b"{not json"
    assert http.get("/x").content == blob


def test_hang_and_drop_fail_the_client(up: ScriptedUpstream, http: httpx.Client, client: openai.OpenAI) -> None:
    up.enqueue(Hang(5), Hang(5), Drop())
    with pytest.raises(httpx.ReadTimeout):
        http.get("/models", timeout=0.1)
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.1).models.list()
    with pytest.raises(httpx.RemoteProtocolError):
        http.get("/models")
    up.enqueue(Hang(0.01, then=JSONReply({"late": True})))
    assert http.get("/models").json() == {"late": True}


ERRORS = [(400, openai.BadRequestError), (401, openai.AuthenticationError),
          (429, openai.RateLimitError), (500, openai.InternalServerError)]


@pytest.mark.parametrize(("status", "error_class"), ERRORS)
def test_error_reply_raises_the_matching_sdk_error(up: ScriptedUpstream, client: openai.OpenAI, status: int,
                                                   error_class: type[openai.APIStatusError]) -> None:
    up.enqueue(ErrorReply(status, "nope", code="c1", headers={"retry-after": "0"}))
    with pytest.raises(error_class) as caught:
        client.chat.completions.create(model="m", messages=HELLO)
    assert (caught.value.status_code, caught.value.code) == (status, "c1")
    assert caught.value.response.headers["retry-after"] == "0"


async def test_works_from_async_tests_with_latency_knobs() -> None:
    with ScriptedUpstream(chunks=5, first_token_delay=0.01, chunk_delay=(0.0, 0.01)) as up:
        async with openai.AsyncOpenAI(base_url=up.base_url, api_key="k", max_retries=0) as sdk:
            stream = await sdk.chat.completions.create(model="m", messages=HELLO, stream=True)
            pieces = [c.choices[0].delta.content async for c in stream if c.choices[0].delta.content]
    assert len(pieces) == 5 and "".join(pieces) == "echo: hello"
