"""Usage per key and user (docs/usage.md): every format's tokens, streamed or not, the
memory tokens injected and the errors, in GET /v1/admin/usage; quotas over the limit get
429 in each format's envelope and reach no upstream. Real server, real SDKs, the scripted
upstream (which sends a chat stream's usage chunk only when asked, as OpenAI does)."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.formats import message_events, message_object, response_events, response_object
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import (
    ErrorReply,
    JSONReply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)
from tests.support.sql import query

Starter = Callable[..., RunningProxy]
ADMIN = "admin-key-usage-01"
ALICE = "key-alice-000001"  # bound to alice
TEAM = "key-team-0000002"  # unbound: names its users
QUOTA = "key-quota-000003"  # bound to carol, 100 tokens a month
KEYS = f"{ALICE}:alice,{TEAM},{QUOTA}:carol:quota=100"


def origin(upstream: ScriptedUpstream) -> str:
    return upstream.base_url.removesuffix("/v1")


@pytest.fixture
def served(start_proxy: Starter, upstream: ScriptedUpstream) -> RunningProxy:
    return start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN,
                       anthropic_base_url=origin(upstream))


def admin_usage(proxy: RunningProxy, key: str = ADMIN, **params: str) -> httpx.Response:
    with httpx.Client(base_url=proxy.url, timeout=20) as http:
        return http.get("/v1/admin/usage", params=params,
                        headers={"Authorization": f"Bearer {key}"} if key else {})


def usage_of(proxy: RunningProxy, **params: str) -> dict[str, Any]:
    response = admin_usage(proxy, **params)
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    return report


def key_id(proxy: RunningProxy, secret: str) -> str:
    return str(next(k.key_id for k in proxy.state.settings.api_keys if k.key == secret))


def row(report: dict[str, Any], key: str, user: str) -> dict[str, Any]:
    rows = [r for r in report["data"] if r["key_id"] == key and r["user_id"] == user]
    assert len(rows) == 1, report["data"]
    found: dict[str, Any] = rows[0]
    return found


def sdk(proxy: RunningProxy, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0, timeout=20,
                         default_headers=headers)


def streamed_chunks(client: openai.OpenAI, **extra: Any) -> list[Any]:
    stream = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hello there"}],
        stream=True, **extra)
    return list(stream)


def echo_completion_tokens(text: str) -> int:
    """What the scripted upstream says an answer of `text` cost."""
    last: dict[str, Any] = chat_chunks(text, include_usage=True)[-1]
    return int(last["usage"]["completion_tokens"])


@pytest.mark.both_backends
def test_chat_tokens_json_and_streamed_per_key_and_user(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    alice = key_id(served, ALICE)
    with sdk(served, ALICE) as client:
        upstream.enqueue(JSONReply(chat_completion("hi", usage={
            "prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38})))
        whole = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        assert whole.usage is not None and whole.usage.prompt_tokens == 31
        # Not asked: memproxy asks the upstream, counts, and the client sees no usage at all.
        unasked = streamed_chunks(client)
        asked_upstream = upstream.history[-1].json
        assert asked_upstream["stream_options"] == {"include_usage": True}
        assert all(chunk.choices for chunk in unasked), "a chunk without choices reached the client"
        assert all(chunk.usage is None for chunk in unasked)
        assert "".join(c.choices[0].delta.content or "" for c in unasked) == "echo: hello there"
        unasked_tokens = (len(upstream.history[-1].body) // 4,
                          echo_completion_tokens("echo: hello there"))
        # Asked: the client gets its usage chunk, untouched.
        asked = streamed_chunks(client, stream_options={"include_usage": True})
        assert asked[-1].choices == [] and asked[-1].usage is not None
        asked_tokens = (asked[-1].usage.prompt_tokens, asked[-1].usage.completion_tokens)
    report = usage_of(served, key_id=alice)
    mine = row(report, alice, "alice")
    assert mine["requests"] == 3 and mine["errors"] == 0
    assert mine["input_tokens"] == 31 + unasked_tokens[0] + asked_tokens[0]
    assert mine["output_tokens"] == 7 + unasked_tokens[1] + asked_tokens[1]
    assert report["by_key"] == [{"key_id": alice, **{k: mine[k] for k in report["totals"]}}]
    assert report["by_user"] == [{"user_id": "alice", **{k: mine[k] for k in report["totals"]}}]
    assert report["totals"]["requests"] == 3
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    assert mine["day"] == today and report["to"] == today and report["from"] == today[:8] + "01"


@pytest.mark.both_backends
def test_counts_survive_a_restart_and_the_next_process_adds_to_the_same_rows(
    start_proxy: Starter, upstream: ScriptedUpstream
) -> None:
    first = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN)
    chat(first, "one", api_key=TEAM, user="dan")
    chat(first, "two", api_key=TEAM, user="erin")
    settings = first.state.settings
    first.stop()  # the last counts are written at shutdown
    rows = query(settings, "SELECT user_id, requests FROM usage_daily ORDER BY user_id")
    assert rows == [("dan", 1), ("erin", 1)]
    second = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN)
    chat(second, "three", api_key=TEAM, user="dan")
    report = usage_of(second, user="dan")
    assert [(r["user_id"], r["requests"]) for r in report["data"]] == [("dan", 2)]
    assert report["by_user"][0]["input_tokens"] > 0


def test_responses_and_messages_are_counted_streamed_or_not(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    team = key_id(served, TEAM)
    with sdk(served, TEAM, **{"X-Memory-User-Id": "rita"}) as client:
        upstream.enqueue(JSONReply(response_object("ok", input_tokens=40)))
        whole = client.responses.create(model="gpt-4o-mini", input="hi")
        upstream.enqueue(SSEReply(response_events("streamed ok", input_tokens=50), done=False))
        events = list(client.responses.create(model="gpt-4o-mini", input="hi", stream=True))
    completed = next(e for e in events if e.type == "response.completed").response
    assert whole.usage is not None and completed.usage is not None
    rita = row(usage_of(served, user="rita"), team, "rita")
    assert rita["requests"] == 2
    assert rita["input_tokens"] == 40 + 50 == whole.usage.input_tokens + completed.usage.input_tokens
    assert rita["output_tokens"] == whole.usage.output_tokens + completed.usage.output_tokens

    with anthropic.Anthropic(base_url=served.url, api_key=TEAM, max_retries=0, timeout=20,
                             default_headers={"X-Memory-User-Id": "max"}) as claude:
        upstream.enqueue(JSONReply(message_object("fine", input_tokens=60)))
        message = claude.messages.create(model="claude-x", max_tokens=50,
                                         messages=[{"role": "user", "content": "hi"}])
        upstream.enqueue(SSEReply(message_events("fine too", input_tokens=70), done=False))
        with claude.messages.stream(model="claude-x", max_tokens=50,
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            final = stream.get_final_message()
    maxed = row(usage_of(served, user="max"), team, "max")
    assert maxed["requests"] == 2
    assert maxed["input_tokens"] == 60 + 70
    assert maxed["output_tokens"] == message.usage.output_tokens + final.usage.output_tokens > 0


def test_memory_tokens_and_errors_are_counted(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    alice = key_id(served, ALICE)
    chat(served, "Our billing service runs on Postgres 16 with the pgvector extension.",
         api_key=ALICE, session="s1")
    wait_for_jobs(served)
    reply = chat(served, "Which database does the billing service use?", api_key=ALICE,
                 session="s2")
    injected = int(reply.headers["x-memory-injected-tokens"])
    assert injected > 0
    upstream.enqueue(ErrorReply(500, "the model fell over"))
    # Memory off here, so the memory tokens are the one header's.
    with sdk(served, ALICE, **{"X-Memory": "off"}) as client, \
            pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="gpt-4o-mini",
                                       messages=[{"role": "user", "content": "x"}])
    with httpx.Client(base_url=served.url, timeout=20) as http:  # a malformed body: 400
        bad = http.post("/v1/chat/completions", content=b"{not json",
                        headers={"Authorization": f"Bearer {ALICE}",
                                 "Content-Type": "application/json"})
    assert bad.status_code == 400
    mine = row(usage_of(served, key_id=alice), alice, "alice")
    assert mine["requests"] == 4 and mine["errors"] == 2
    assert mine["memory_tokens"] == injected


@pytest.fixture
def spent(served: RunningProxy, upstream: ScriptedUpstream) -> Iterator[RunningProxy]:
    """carol's key, its 100 tokens spent by one reply."""
    upstream.enqueue(JSONReply(chat_completion("big", usage={
        "prompt_tokens": 80, "completion_tokens": 30, "total_tokens": 110})))
    chat(served, "spend it", api_key=QUOTA)
    yield served


def test_a_spent_quota_is_429_in_each_format_and_reaches_no_upstream(
    spent: RunningProxy, upstream: ScriptedUpstream
) -> None:
    sent = len(upstream.history)
    with sdk(spent, QUOTA) as client:
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as chat_refusal:
                client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "more"}],
                    stream=stream)
            error = chat_refusal.value.response.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "token_quota_exceeded"
            assert "monthly token quota is spent" in error["message"]
            assert "110 of 100 tokens" in error["message"] and "resets at" in error["message"]
            assert int(chat_refusal.value.response.headers["retry-after"]) > 0
        with pytest.raises(openai.RateLimitError) as responses_refusal:
            client.responses.create(model="gpt-4o-mini", input="more")
        assert responses_refusal.value.response.json()["error"]["code"] == "token_quota_exceeded"
    with anthropic.Anthropic(base_url=spent.url, api_key=QUOTA, max_retries=0,
                             timeout=20) as claude, pytest.raises(anthropic.RateLimitError) as caught:
        claude.messages.create(model="claude-x", max_tokens=10,
                               messages=[{"role": "user", "content": "more"}])
    body = caught.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "monthly token quota is spent" in body["error"]["message"]
    with httpx.Client(base_url=spent.url, timeout=20) as http:  # the pass-through too
        models = http.get("/v1/models", headers={"Authorization": f"Bearer {QUOTA}"})
    assert models.status_code == 429
    assert len(upstream.history) == sent, "a spent key's request reached the upstream"
    # Other keys go on; the refusals are counted as errors of carol's key.
    assert chat(spent, "still fine", api_key=ALICE).status == 200
    carol = row(usage_of(spent, user="carol"), key_id(spent, QUOTA), "carol")
    assert carol["requests"] == 1 + 5 and carol["errors"] == 5
    assert carol["input_tokens"] + carol["output_tokens"] == 110


def test_the_admin_usage_api_answers_the_admin_key_only(
    served: RunningProxy, start_proxy: Starter
) -> None:
    assert admin_usage(served, key="").status_code == 401
    assert admin_usage(served, key="not-a-key-at-all").status_code == 401
    for key in (ALICE, TEAM):
        refused = admin_usage(served, key=key)
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "permission_error"
    without_admin = start_proxy(memory=True, api_keys=KEYS)
    assert admin_usage(without_admin, key=ALICE).status_code == 403


def test_filters_and_bad_parameters(served: RunningProxy) -> None:
    chat(served, "a", api_key=TEAM, user="u1")
    chat(served, "b", api_key=TEAM, user="u2")
    chat(served, "c", api_key=ALICE)
    team = key_id(served, TEAM)
    everyone = usage_of(served)
    assert everyone["totals"]["requests"] == 3 and len(everyone["data"]) == 3
    assert [r["user_id"] for r in usage_of(served, key_id=team)["data"]] == ["u1", "u2"]
    assert [r["user_id"] for r in usage_of(served, user="u2")["data"]] == ["u2"]
    limited = usage_of(served, limit="1")
    assert len(limited["data"]) == 1 and limited["has_more"] is True
    assert limited["totals"]["requests"] == 3  # the sums count every row
    assert usage_of(served, **{"from": "2001-01-01", "to": "2001-01-31"})["data"] == []
    for params, param in [
        ({"from": "yesterday"}, "from"), ({"to": "2026-02-30"}, "to"),
        ({"from": "2026-W47-1"}, "from"), ({"from": "2026-03-02", "to": "2026-03-01"}, "from"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "from"), ({"limit": "0"}, "limit"),
        ({"limit": "-3"}, "limit"), ({"user": "x" * 300}, "user"), ({"key_id": ""}, "key_id"),
        ({"group": "key"}, "group"),
    ]:
        response = admin_usage(served, **params)
        assert response.status_code == 400, (params, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param


def test_the_litellm_transport_is_counted_and_stripped_too(
    start_proxy: Starter, upstream: ScriptedUpstream
) -> None:
    from config import Route

    proxy = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN, upstream_api_key="sk-up", routes=(
        Route("via-litellm-*", base_url=upstream.base_url, api_key="sk-route", provider="openai"),
    ))
    with sdk(proxy, ALICE) as client:
        chunks = list(client.chat.completions.create(
            model="via-litellm-4o", messages=[{"role": "user", "content": "hello there"}],
            stream=True))
    assert upstream.history[-1].json["stream_options"]["include_usage"] is True
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "echo: hello there"
    # Messages without an Anthropic upstream: litellm translates to chat completions.
    with anthropic.Anthropic(base_url=proxy.url, api_key=ALICE, max_retries=0, timeout=20) as claude:
        claude.messages.create(model="gpt-4o-mini", max_tokens=20,
                               messages=[{"role": "user", "content": "hi"}])
        with claude.messages.stream(model="gpt-4o-mini", max_tokens=20,
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            final = stream.get_final_message()
    mine = row(usage_of(proxy), key_id(proxy, ALICE), "alice")
    assert mine["requests"] == 3
    assert final.usage.output_tokens > 0  # litellm asked the upstream for a stream's usage too
    assert mine["input_tokens"] > 0 and mine["output_tokens"] > echo_completion_tokens(
        "echo: hello there") + final.usage.output_tokens


def test_the_usage_command(served: RunningProxy, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli.main import main

    chat(served, "a", api_key=TEAM, user="u1")
    chat(served, "b", api_key=ALICE)
    assert main(["usage", "--url", served.url, "--key", ADMIN]) == 0
    shown = capsys.readouterr().out
    assert "DAY" in shown and "u1" in shown and "alice" in shown and "2 requests" in shown
    assert main(["usage", "--url", served.url, "--key", ADMIN, "--by", "user", "--json",
                 "--user", "u1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["user_id"] for r in report["data"]] == ["u1"] and report["totals"]["requests"] == 1
    assert main(["usage", "--url", served.url, "--key", ADMIN, "--by", "key"]) == 0
    assert key_id(served, TEAM) in capsys.readouterr().out
    assert main(["usage", "--url", served.url, "--key", ALICE]) == 1
    assert "admin" in capsys.readouterr().err
    assert main(["usage", "--url", served.url, "--key", ADMIN, "--from", "nope"]) == 1
    assert "YYYY-MM-DD" in capsys.readouterr().err


def test_counts_wait_out_a_database_outage(start_proxy: Starter) -> None:
    """Nothing accepted is lost: counts the database cannot take are written once it is back."""
    from tests.support.servers import PostgresServer

    with PostgresServer() as server:
        proxy = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN,
                            database_url=server.create_database(), usage_flush_seconds=0.1)
        chat(proxy, "before", api_key=TEAM, user="olga", headers={"X-Memory": "off"})
        assert usage_of(proxy, user="olga")["totals"]["requests"] == 1
        server.stop()
        for text in ("during", "the outage"):  # the chat goes on; its counts wait
            assert chat(proxy, text, api_key=TEAM, user="olga",
                        headers={"X-Memory": "off"}).status == 200
        time.sleep(0.5)  # several flushes fail meanwhile
        server.start()
        deadline = time.monotonic() + 30
        while True:
            response = admin_usage(proxy, user="olga")
            if response.status_code == 200 and response.json()["totals"]["requests"] == 3:
                break
            assert time.monotonic() < deadline, response.text
            time.sleep(0.2)
        assert response.json()["totals"]["input_tokens"] > 0


def test_a_quota_spent_on_one_replica_is_refused_on_another(
    start_proxy: Starter, upstream: ScriptedUpstream, postgres_server: Any, tmp_path: Any
) -> None:
    """Replicas share the month's tokens through the database: within the flush interval
    and the quota cache (2 s), another replica refuses the spent key."""
    url = postgres_server.create_database()
    first = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN, database_url=url,
                        usage_flush_seconds=0.2)
    second = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN, database_url=url,
                         usage_flush_seconds=0.2, data_dir=tmp_path / "second")
    assert chat(second, "warm the cache", api_key=QUOTA).status == 200  # carol's month: 0 read
    upstream.enqueue(JSONReply(chat_completion("big", usage={
        "prompt_tokens": 80, "completion_tokens": 30, "total_tokens": 110})))
    chat(first, "spend it", api_key=QUOTA)
    started, slipped = time.monotonic(), 0
    with sdk(second, QUOTA) as client:
        while True:
            try:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
                slipped += 1
            except openai.RateLimitError as refused:
                assert refused.response.json()["error"]["code"] == "token_quota_exceeded"
                break
            assert time.monotonic() - started < 5, "the other replica never saw the spent quota"
            time.sleep(0.1)
    assert time.monotonic() - started < 3.5  # flush (0.2 s) + the quota cache (2 s) + slack
