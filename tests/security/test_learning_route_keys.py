"""Learning through the conversation's route never moves a client's key elsewhere (issue 27).

Actor: a client using bring-your-own-key on one route; asset: its provider key. The key may
go only to the host it was sent to, never into a job payload, and a proxy key never reaches
an upstream as a learning credential.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest

from config.routing import Route
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.demo_model import DemoModel
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import query

pytestmark = pytest.mark.both_backends
SAID = [{"role": "user", "content": "My name is Ada and I like green tea."}]


@pytest.fixture
def anthropic_side() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream() as up:
        up.respond_with(DemoModel())
        yield up


def secrets_seen(up: ScriptedUpstream) -> str:
    return json.dumps([r.headers for r in up.history])


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_key_stays_with_the_anthropic_host(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    anthropic_side: ScriptedUpstream, stream: bool,
) -> None:
    upstream.respond_with(DemoModel())  # the OpenAI side could answer, but must not be asked
    proxy = start_proxy(memory=True, extract_every=1, summary_every=1,
                        anthropic_base_url=anthropic_side.base_url)
    key = "sk-ant-byok-secret-0001"
    with anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0,
                             default_headers={"X-Memory-User-Id": "ada"}) as claude:
        if stream:
            with claude.messages.stream(model="claude-x", max_tokens=50, messages=SAID) as s:  # type: ignore[arg-type]
                s.until_done()
        else:
            claude.messages.create(model="claude-x", max_tokens=50, messages=SAID)  # type: ignore[arg-type]
    assert "dead" not in wait_for_jobs(proxy)
    assert key not in secrets_seen(upstream) and upstream.history == []
    learning = [r for r in anthropic_side.history if "You extract" in str(r.json)]
    assert learning and all(r.headers["x-api-key"] == key for r in learning)
    payloads = query(proxy.state.settings, "SELECT payload FROM jobs", ())
    assert payloads and all(key not in str(p[0]) for p in payloads)
    assert all(json.loads(p[0]).get("route") in (None, "anthropic") for p in payloads)


def test_a_proxy_key_is_never_a_learning_credential(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    anthropic_side: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, extract_every=1, api_keys="pk-proxy-secret-01:ada",
                        anthropic_base_url=anthropic_side.base_url)
    for headers in ({"x-api-key": "pk-proxy-secret-01"},
                    {"authorization": "Bearer pk-proxy-secret-01"}):
        response = httpx.post(f"{proxy.url}/v1/messages", headers=headers, timeout=30, json={
            "model": "claude-x", "max_tokens": 50, "messages": SAID})
        assert response.status_code == 200, response.text
    wait_for_jobs(proxy, timeout=30)
    assert "pk-proxy-secret-01" not in secrets_seen(anthropic_side)
    assert "pk-proxy-secret-01" not in secrets_seen(upstream)
    ready = httpx.get(f"{proxy.url}/readyz").json()["parts"]["learning"]
    assert ready == "ok"  # a loopback upstream may take no key


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/models"])
def test_the_admin_key_never_reaches_an_upstream(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, route: str
) -> None:
    """With only the admin key configured a chat is bring-your-own-key, but a client (or a
    tool copying its admin configuration) that sends the admin key must not hand it to the
    model provider: it is memproxy's own credential, as a proxy key is."""
    upstream.respond_with(DemoModel())
    admin = "admin-key-secret-0001"
    proxy = start_proxy(memory=True, admin_key=admin, extract_every=1)
    headers = {"Authorization": f"Bearer {admin}", "X-Memory-User-Id": "ada"}
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        if route == "/v1/models":
            http.get(route, headers=headers)
        else:
            http.post(route, headers=headers, json={"model": "gpt-4o", "messages": SAID})
    wait_for_jobs(proxy)
    assert upstream.history and admin not in secrets_seen(upstream)


# -- issue 37, item 11: the learning key goes only to the host it belongs to

LEARNING_KEY = "sk-ant-learning-key-secret-0001"


@pytest.fixture
def local_route() -> Iterator[ScriptedUpstream]:
    """A keyless local model server on a route of its own (a second scripted upstream)."""
    with ScriptedUpstream() as up:
        up.respond_with(DemoModel())
        yield up


def learning_calls(up: ScriptedUpstream) -> list[Any]:
    return [r for r in up.history if "You extract" in str(r.json)]


@pytest.mark.parametrize("stream", [False, True])
def test_the_learning_key_never_reaches_a_keyless_local_route(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    anthropic_side: ScriptedUpstream, local_route: ScriptedUpstream, stream: bool,
) -> None:
    upstream.respond_with(DemoModel())
    proxy = start_proxy(memory=True, extract_every=1, learning_api_key=LEARNING_KEY,
                        anthropic_base_url=anthropic_side.base_url,
                        routes=(Route("local-*", base_url=local_route.base_url),))
    said = chat(proxy, SAID, user="ada", session="local", model="local-llama", stream=stream,
                api_key="sk-local-client")
    assert said.status == 200
    assert "dead" not in wait_for_jobs(proxy)
    assert learning_calls(local_route)  # extraction went the conversation's way
    assert LEARNING_KEY not in secrets_seen(local_route)
    # It borrowed the key the client sent to that host, and only that.
    assert {r.headers.get("authorization") for r in learning_calls(local_route)} == {
        "Bearer sk-local-client"}
    assert LEARNING_KEY not in secrets_seen(upstream)
    # On the route it belongs to (Anthropic, by default) the learning key is used.
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client-0001", max_retries=0,
                             default_headers={"X-Memory-User-Id": "bo"}) as claude:
        claude.messages.create(model="claude-x", max_tokens=50, messages=SAID)  # type: ignore[arg-type]
    assert "dead" not in wait_for_jobs(proxy)
    assert {r.headers["x-api-key"] for r in learning_calls(anthropic_side)} == {LEARNING_KEY}


@pytest.mark.parametrize("home", ["default", "local route named", "default named"])
def test_the_learning_key_goes_only_to_the_base_url_it_is_configured_for(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    local_route: ScriptedUpstream, home: str,
) -> None:
    """Without an Anthropic upstream the key belongs to the default upstream; with
    MEMPROXY_LEARNING_API_KEY_URL to that base URL's scheme, host and port only."""
    upstream.respond_with(DemoModel())
    url = {"default": None, "local route named": local_route.base_url,
           "default named": upstream.base_url}[home]
    proxy = start_proxy(memory=True, extract_every=1, learning_api_key=LEARNING_KEY,
                        learning_api_key_url=url,
                        routes=(Route("local-*", base_url=local_route.base_url),))
    for model, user in (("local-llama", "ada"), ("gpt-4o", "bo")):
        assert chat(proxy, SAID, user=user, model=model, api_key="sk-client-0001").status == 200
    assert "dead" not in wait_for_jobs(proxy)
    local, default = learning_calls(local_route), learning_calls(upstream)
    assert local and default
    local_keys = {r.headers.get("authorization") for r in local}
    default_keys = {r.headers.get("authorization") for r in default}
    if home == "local route named":
        assert local_keys == {f"Bearer {LEARNING_KEY}"} and LEARNING_KEY not in secrets_seen(upstream)
    else:
        assert LEARNING_KEY not in secrets_seen(local_route) and local_keys == {"Bearer sk-client-0001"}
        assert default_keys == {f"Bearer {LEARNING_KEY}"}
