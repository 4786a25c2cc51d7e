"""A request body never chooses where an upstream key goes (security review, item 1).

Routes with a `provider`, and /v1/messages without `anthropic_base_url`, go through litellm,
which reads hosts, keys, headers and providers from its keyword arguments. A body field of
one of those names used to send the route's key (or the upstream key) to a host the client
chose. Here a second scripted server, the "attacker", listens on 127.0.0.1: it must receive
nothing, whatever the body says, in every format, streamed or not, while the format's own
parameters still reach the real upstream with the configured key.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from config import Route
from tests.conftest import RunningProxy
from tests.support.scripted_upstream import Received, ScriptedUpstream

ROUTE_KEY = "sk-route-secret"
ANTHROPIC_KEY = "sk-ant-route-secret"
UPSTREAM_KEY = "sk-upstream-secret"
KEYS = (ROUTE_KEY, ANTHROPIC_KEY, UPSTREAM_KEY)


@pytest.fixture
def attacker() -> Iterator[ScriptedUpstream]:
    """A host the client would like the key sent to."""
    with ScriptedUpstream() as server:
        yield server


def smuggled(url: str) -> dict[str, dict[str, Any]]:
    """Body fields that name a host, a credential, headers or a provider (litellm's own
    keyword arguments and spellings of them), each aimed at the attacker at `url`."""
    origin = url.removesuffix("/v1")
    return {
        "base_url": {"base_url": url},
        "api_base": {"api_base": url},
        "api_base origin": {"api_base": origin},
        "base_url and provider": {"base_url": url, "custom_llm_provider": "openai"},
        "custom_llm_provider": {"custom_llm_provider": "anthropic", "api_base": origin},
        "api_key": {"api_key": "sk-chosen-by-client"},
        "extra_headers": {"extra_headers": {"x-smuggled": "1", "authorization": "Bearer sk-chosen"}},
        "headers": {"headers": {"x-smuggled": "1", "x-api-key": "sk-chosen"}},
        "extra_body": {"extra_body": {"api_base": url, "base_url": url}},
        "litellm_params": {"litellm_params": {"api_base": url, "api_key": "sk-chosen"}},
        "model_list": {"model_list": [{"model_name": "x", "litellm_params": {
            "model": "openai/x", "api_base": url}}]},
        "fallbacks": {"fallbacks": [{"model": "openai/x", "api_base": url}], "mock_testing_fallbacks": True},
        "azure": {"azure_endpoint": url, "api_version": "2024-01-01"},
        "mock_response": {"mock_response": "not from the upstream"},
    }


@dataclass(frozen=True)
class Case:
    """One way a body reaches litellm: the route, the request and what the upstream gets."""

    name: str
    path: str  # memproxy's route
    body: dict[str, Any]
    upstream_path: str  # where the real upstream receives it
    key_header: str
    key_value: str
    routes: tuple[Route, ...] = ()
    settings: tuple[tuple[str, Any], ...] = ()
    # litellm's native Anthropic stream imports litellm.proxy, which needs fastapi (not
    # installed): such a stream fails before it starts, so only the attacker is checked.
    streams: bool = True


def cases(upstream: ScriptedUpstream) -> list[Case]:
    origin = upstream.base_url.removesuffix("/v1")
    routes = (
        Route("via-litellm-*", base_url=upstream.base_url, api_key=ROUTE_KEY, provider="openai"),
        Route("claude-*", base_url=origin, api_key=ANTHROPIC_KEY, provider="anthropic"),
    )
    hi = [{"role": "user", "content": "hi"}]
    return [
        Case("chat", "/v1/chat/completions", {"model": "via-litellm-x", "messages": hi},
             "/v1/chat/completions", "authorization", f"Bearer {ROUTE_KEY}", routes),
        Case("responses", "/v1/responses", {"model": "via-litellm-x", "input": "hi"},
             "/v1/responses", "authorization", f"Bearer {ROUTE_KEY}", routes),
        # The reproduction: the upstream key and no anthropic_base_url.
        Case("messages default", "/v1/messages",
             {"model": "some-model", "max_tokens": 50, "messages": hi},
             "/v1/chat/completions", "authorization", f"Bearer {UPSTREAM_KEY}",
             settings=(("upstream_api_key", UPSTREAM_KEY),)),
        Case("messages anthropic route", "/v1/messages",
             {"model": "claude-x", "max_tokens": 50, "messages": hi},
             "/v1/messages", "x-api-key", ANTHROPIC_KEY, routes, streams=False),
    ]


CASE_NAMES = ["chat", "responses", "messages default", "messages anthropic route"]


def the_case(name: str, upstream: ScriptedUpstream) -> Case:
    return next(c for c in cases(upstream) if c.name == name)


def start(start_proxy: Callable[..., RunningProxy], case: Case) -> RunningProxy:
    return start_proxy(routes=case.routes, **dict(case.settings))


def leak(received: Received) -> str:
    """What the attacker got: always a failure, worse with a key."""
    seen = str(received.headers) + received.body.decode("utf-8", "replace")
    keys = [key for key in KEYS if key in seen]
    return f"the attacker got {received.method} {received.path}" + (f" with {keys}" if keys else "")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_body_fields_never_choose_the_host_the_key_or_the_headers(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    attacker: ScriptedUpstream, name: str, stream: bool,
) -> None:
    case = the_case(name, upstream)
    proxy = start(start_proxy, case)
    failures = []
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for variant, fields in smuggled(attacker.base_url).items():
            before, contacted = len(upstream.history), len(attacker.history)
            reply = http.post(case.path, json={**case.body, **fields, "stream": stream},
                              headers={"authorization": "Bearer sk-client"})
            problems = [leak(received) for received in attacker.history[contacted:]]
            if stream and not case.streams:
                failures += [(variant, problems)] if problems else []
                continue
            got = upstream.history[before:]
            problems += [
                f"status {reply.status_code}: {reply.text[:200]}" if reply.status_code != 200 else "",
                "not from the upstream" if "not from the upstream" in reply.text else "",
                f"the upstream got {[r.path for r in got]}" if [r.path for r in got] != [case.upstream_path] else "",
            ]
            if got:
                sent = got[-1]
                problems += [
                    "wrong key" if sent.headers.get(case.key_header) != case.key_value else "",
                    "smuggled header" if "x-smuggled" in sent.headers else "",
                    "client key" if "sk-chosen" in str(sent.headers) + sent.body.decode() else "",
                ]
            if any(problems):
                failures.append((variant, [p for p in problems if p]))
    assert not failures, failures


def test_the_formats_own_parameters_still_reach_the_upstream(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    chat, responses, messages = (the_case(n, upstream) for n in ("chat", "responses", "messages default"))
    proxy = start_proxy(routes=chat.routes, upstream_api_key=UPSTREAM_KEY)
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for stream in (False, True):
            assert http.post(chat.path, json={
                **chat.body, "stream": stream, "temperature": 0.25, "max_tokens": 77, "top_p": 0.5,
                "stop": ["STOP"], "tools": [tool], "tool_choice": "auto", "seed": 7,
                "presence_penalty": 0.1,
            }).status_code == 200
            sent = upstream.history[-1].json
            assert (sent["temperature"], sent["max_tokens"], sent["top_p"], sent["seed"]) == (0.25, 77, 0.5, 7)
            assert sent["stop"] == ["STOP"] and sent["tools"][0]["function"]["name"] == "lookup"
            assert sent["tool_choice"] == "auto" and sent["presence_penalty"] == 0.1
            assert sent.get("stream", False) is stream

            assert http.post(responses.path, json={
                **responses.body, "stream": stream, "temperature": 0.25, "max_output_tokens": 77,
                "instructions": "Be brief.", "top_p": 0.5, "user": "u-1",
                "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
            }).status_code == 200
            sent = upstream.history[-1].json
            assert (sent["temperature"], sent["max_output_tokens"], sent["instructions"]) == (0.25, 77, "Be brief.")
            assert sent["tools"][0]["name"] == "lookup" and sent["top_p"] == 0.5
            # (litellm asks for a whole response and streams it itself for a model it
            # does not know)

            assert http.post(messages.path, json={
                **messages.body, "stream": stream, "temperature": 0.25, "max_tokens": 77,
                "stop_sequences": ["STOP"], "system": "Be brief.", "top_p": 0.5,
                "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
            }).status_code == 200
            sent = upstream.history[-1].json
            assert (sent["temperature"], sent["max_tokens"], sent["stop"]) == (0.25, 77, ["STOP"])
            assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
            assert sent["tools"][0]["function"]["name"] == "lookup"
            assert sent.get("stream", False) is stream


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_upstream_failures_name_the_route_not_an_address(
    start_proxy: Callable[..., RunningProxy], stream: bool
) -> None:
    port = closed_port()
    proxy = start_proxy(routes=(
        Route("via-litellm-*", base_url=f"http://127.0.0.1:{port}/v1", api_key=ROUTE_KEY,
              provider="openai"),
    ))
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/responses", {"input": "hi"}),
            ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        ):
            reply = http.post(path, json={"model": "via-litellm-x", "stream": stream, **body})
            assert reply.status_code in (502, 504), reply.text
            error = orjson.loads(reply.content)["error"]
            assert str(port) not in reply.text and "127.0.0.1" not in reply.text, reply.text
            assert ROUTE_KEY not in reply.text
            assert "via-litellm-*" in error["message"], error


def test_no_format_lists_a_host_a_key_headers_or_a_provider() -> None:
    from proxy.formats.chat_body import CHAT_PARAMS
    from proxy.formats.messages_body import MESSAGES_PARAMS
    from proxy.formats.responses import RESPONSES_PARAMS

    litellms_own = {
        "model", "base_url", "api_base", "api_key", "api_version", "azure_endpoint", "headers",
        "extra_headers", "extra_body", "extra_query", "custom_llm_provider", "model_list",
        "client", "shared_session", "deployment_id", "fallbacks", "litellm_params",
        "mock_response", "timeout", "num_retries", "aws_access_key_id", "vertex_credentials",
    }
    for allowed in (CHAT_PARAMS, RESPONSES_PARAMS, MESSAGES_PARAMS):
        assert not allowed & litellms_own, allowed & litellms_own
