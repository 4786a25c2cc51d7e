"""Learning goes through the route that served the conversation (issue 27, item 1).

Behind Claude Code (`MEMPROXY_ANTHROPIC_BASE_URL`), extraction and summaries are Messages
calls to that upstream with its key policy; no OpenAI upstream is reachable here at all.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support.formats import message_object
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import JSONReply, Received, Reply, ScriptedUpstream
from tests.support.sql import query

pytestmark = pytest.mark.both_backends

MODEL = "claude-scripted-1"
EXTRACT = "You extract durable facts"
SUMMARY = "You summarise a conversation"
FACT = {"fact": "User's sister Ines lives in Porto.", "category": "relationship",
        "confidence": 0.9, "importance": 8, "updates_previous": None, "expires": None,
        "turns": [1]}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PlaysClaude:
    """Answers memproxy's learning prompts sent as Anthropic Messages; records them."""

    def __init__(self) -> None:
        self.learning: list[Received] = []

    def __call__(self, request: Received) -> Reply | None:
        body = request.json if isinstance(request.json, dict) else {}
        system = body.get("system")
        text = system if isinstance(system, str) else ""
        if not request.path.endswith("/messages") or not text.startswith((EXTRACT, SUMMARY)):
            return None
        self.learning.append(request)
        answer = json.dumps([FACT]) if text.startswith(EXTRACT) else '{"text": "Ines, Porto."}'
        return JSONReply(message_object(answer, model=str(body.get("model"))))


@pytest.fixture
def plays(upstream: ScriptedUpstream) -> PlaysClaude:
    player = PlaysClaude()
    upstream.respond_with(player)
    return player


@pytest.fixture
def messages_only(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> Callable[..., RunningProxy]:
    """memproxy whose only reachable upstream speaks Messages."""

    def start(**changes: Any) -> RunningProxy:
        settings: dict[str, Any] = {
            "anthropic_base_url": upstream.base_url.removesuffix("/v1"),
            "upstream_base_url": f"http://127.0.0.1:{closed_port()}/v1", "extract_every": 1,
        }
        return start_proxy(memory=True, **{**settings, **changes})

    return start


@pytest.fixture
def claude() -> Iterator[Callable[[RunningProxy, str], anthropic.Anthropic]]:
    made: list[anthropic.Anthropic] = []

    def make(proxy: RunningProxy, key: str) -> anthropic.Anthropic:
        made.append(anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0,
                                        default_headers={"X-Memory-User-Id": "ada"}))
        return made[-1]

    yield make
    for client in made:
        client.close()


def learn_and_recall(proxy: RunningProxy, client: anthropic.Anthropic, upstream: ScriptedUpstream,
                     *, stream: bool = False) -> None:
    said = [{"role": "user", "content": "My sister Ines lives in Porto and teaches violin."}]
    if stream:
        with client.messages.stream(model=MODEL, max_tokens=50, messages=said) as events:  # type: ignore[arg-type]
            events.until_done()
    else:
        client.messages.create(model=MODEL, max_tokens=50, messages=said)  # type: ignore[arg-type]
    counts = wait_for_jobs(proxy)
    assert "dead" not in counts, counts
    facts = query(proxy.state.settings, "SELECT text FROM facts WHERE user_id = ?", ("ada",))
    assert [row[0] for row in facts] == [FACT["fact"]]
    client.messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "Where does my sister live these days?"}])
    assert "Ines lives in Porto" in str(upstream.history[-1].json["system"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_messages_only_deployment_learns_with_the_clients_key(
    messages_only: Callable[..., RunningProxy], upstream: ScriptedUpstream, plays: PlaysClaude,
    claude: Callable[[RunningProxy, str], anthropic.Anthropic], stream: bool,
) -> None:
    proxy = messages_only()
    learn_and_recall(proxy, claude(proxy, "sk-ant-client-key"), upstream, stream=stream)
    assert plays.learning, "no learning call reached the Messages upstream"
    for call in plays.learning:
        assert call.path == "/v1/messages"
        assert call.headers["x-api-key"] == "sk-ant-client-key"
        assert call.json["model"] == MODEL and call.json["max_tokens"] > 0
    ready = httpx.get(f"{proxy.url}/readyz").json()
    assert ready["parts"]["learning"] == "ok"


def test_with_proxy_keys_learning_uses_the_learning_key(
    messages_only: Callable[..., RunningProxy], upstream: ScriptedUpstream, plays: PlaysClaude,
    claude: Callable[[RunningProxy, str], anthropic.Anthropic],
) -> None:
    proxy = messages_only(api_keys="pk-proxy-key-1", learning_api_key="sk-ant-learning")
    learn_and_recall(proxy, claude(proxy, "pk-proxy-key-1"), upstream)
    assert {call.headers["x-api-key"] for call in plays.learning} == {"sk-ant-learning"}
    assert httpx.get(f"{proxy.url}/readyz").json()["parts"]["learning"] == "ok"


def test_readyz_names_the_missing_learning_key(
    messages_only: Callable[..., RunningProxy],
) -> None:
    proxy = messages_only(api_keys="pk-proxy-key-1",
                          anthropic_base_url="https://api.anthropic.com")
    ready = httpx.get(f"{proxy.url}/readyz")
    learning = ready.json()["parts"]["learning"]
    assert "anthropic" in learning and "MEMPROXY_LEARNING_API_KEY" in learning
    assert ready.status_code == 200  # learning does not take the replica out of service
