"""Routes to providers that are not OpenAI-compatible go through litellm and come back as OpenAI."""

from __future__ import annotations

from collections.abc import Callable

import openai

from config import Route
from tests.conftest import RunningProxy
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream

ANTHROPIC_REPLY = {
    "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-test",
    "content": [{"type": "text", "text": "Bonjour from Claude"}],
    "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 12, "output_tokens": 4},
}


def test_anthropic_route_is_translated_both_ways(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    origin = upstream.base_url.removesuffix("/v1")
    proxy = start_proxy(routes=(
        Route("claude-*", base_url=origin, api_key="sk-ant-route", provider="anthropic"),
    ))
    upstream.enqueue(JSONReply(ANTHROPIC_REPLY), path="/v1/messages")
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    completion = client.chat.completions.create(
        model="claude-test", max_tokens=50,
        messages=[{"role": "system", "content": "Be French."}, {"role": "user", "content": "Hi"}],
    )
    assert completion.choices[0].message.content == "Bonjour from Claude"
    assert completion.usage is not None and completion.usage.prompt_tokens == 12
    sent = upstream.history[-1]
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == "sk-ant-route"  # the route's key, not the client's
    assert sent.json["system"] in ("Be French.", [{"type": "text", "text": "Be French."}])
    assert sent.json["messages"][-1]["role"] == "user"


def test_litellm_openai_provider_streams(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(routes=(
        Route("via-litellm-*", base_url=upstream.base_url, api_key="sk-route", provider="openai"),
    ))
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    stream = client.chat.completions.create(
        model="via-litellm-model", stream=True,
        messages=[{"role": "user", "content": "stream me"}],
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "echo: stream me"
    assert upstream.history[-1].headers["authorization"] == "Bearer sk-route"
    assert upstream.history[-1].json["model"] == "via-litellm-model"


def test_litellm_upstream_errors_keep_their_status(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    from tests.support.scripted_upstream import ErrorReply

    proxy = start_proxy(routes=(
        Route("via-litellm-*", base_url=upstream.base_url, api_key="sk-route", provider="openai"),
    ))
    upstream.enqueue(*[ErrorReply(429, "slow down")] * 5)
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    try:
        client.chat.completions.create(model="via-litellm-x", messages=[{"role": "user", "content": "x"}])
    except openai.RateLimitError as exc:
        assert exc.status_code == 429
    else:
        raise AssertionError("expected a 429")


def test_litellm_stream_cut_midway_is_one_error_event_and_counted(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    # The same relay as OpenAI-compatible upstreams: an error event, the upstream error counted.
    import httpx

    from tests.support.scripted_upstream import SSEReply, chat_chunks

    proxy = start_proxy(routes=(
        Route("via-litellm-*", base_url=upstream.base_url, api_key="sk-route", provider="openai"),
    ))
    upstream.enqueue(SSEReply(chat_chunks("one two three four", split=4), cut_after=3))
    with httpx.Client(base_url=proxy.url, timeout=20) as http:
        reply = http.post("/v1/chat/completions", json={
            "model": "via-litellm-x", "stream": True, "messages": [{"role": "user", "content": "x"}],
        })
        metrics = http.get("/metrics").text
    assert reply.status_code == 200
    events = reply.text.strip().split("\n\n")
    assert events[-1].startswith("event: error\ndata: ")
    assert sum(e.startswith("event: error") for e in events) == 1
    assert "[DONE]" not in reply.text
    counted = [line for line in metrics.splitlines() if line.startswith("memproxy_upstream_errors_total")]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, counted


def test_responses_through_litellm_keep_their_format(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(routes=(
        Route("via-litellm-*", base_url=upstream.base_url, api_key="sk-route", provider="openai"),
    ))
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    response = client.responses.create(model="via-litellm-x", input="hello there")
    assert response.output_text == "echo: hello there"
    with client.responses.stream(model="via-litellm-x", input="stream please") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "echo: stream please"
    assert [r.path for r in upstream.history] == ["/v1/responses", "/v1/responses"]
    assert upstream.history[-1].headers["authorization"] == "Bearer sk-route"


def test_responses_to_an_anthropic_route_are_translated(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    origin = upstream.base_url.removesuffix("/v1")
    proxy = start_proxy(routes=(
        Route("claude-*", base_url=origin, api_key="sk-ant-route", provider="anthropic"),
    ))
    upstream.enqueue(JSONReply(ANTHROPIC_REPLY), path="/v1/messages")
    client = openai.OpenAI(base_url=proxy.base_url, api_key="sk-client", max_retries=0)
    response = client.responses.create(model="claude-test", input="Hi", instructions="Be French.",
                                       max_output_tokens=50)
    assert response.output_text == "Bonjour from Claude"
    sent = upstream.history[-1]
    assert sent.path == "/v1/messages" and sent.headers["x-api-key"] == "sk-ant-route"


async def test_a_learning_call_through_litellm_sends_its_own_key_and_trace(
    upstream: ScriptedUpstream,
) -> None:
    from proxy.upstream.client import Target
    from proxy.upstream.litellm_transport import close_clients, complete_text

    target = Target(upstream.base_url, "sk-route", "openai", name="via-litellm-*")
    traceparent = f"00-{'1' * 32}-{'2' * 16}-01"
    try:
        text, reply = await complete_text(
            target, "via-litellm-model", [{"role": "user", "content": "learn me"}], "sk-learning",
            timeout=30, trace={"traceparent": traceparent},
        )
    finally:
        await close_clients()
    assert text == "echo: learn me"
    assert reply["choices"][0]["message"]["content"] == "echo: learn me"
    sent = upstream.history[-1]
    assert sent.headers["authorization"] == "Bearer sk-learning"  # the call's key, not the route's
    assert sent.headers["traceparent"] == traceparent
    assert sent.json == {"model": "via-litellm-model", "temperature": 0,
                         "messages": [{"role": "user", "content": "learn me"}]}
