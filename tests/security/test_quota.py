"""Attacks on token quotas and rate limits (issue 37, items 3 and 4; docs/usage.md "Quotas",
docs/keys.md "Rate limits across replicas", docs/security.md).

A key with a small quota tries to spend past it: streams cut before their usage chunk,
streamed legacy completions through the pass-through, background responses and other
upstream work memproxy cannot count, and 30 requests at once, on one replica and on two
sharing PostgreSQL. A rate-limited key spreads its requests over two replicas. Real
servers, the official SDK and httpx, the scripted upstream on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from memory.tokens import count_tokens
from tests.conftest import RunningProxy
from tests.support.formats import message_events, response_events
from tests.support.scripted_upstream import (
    ErrorReply,
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)
from tests.support.sql import scalar

Starter = Callable[..., RunningProxy]
ADMIN = "admin-key-quota-01"
QUOTA = "key-quota-carol-01"  # bound to carol: 3,000 tokens a month
FREE = "key-free-dave-0001"  # bound to dave: no quota
KEYS = f"{QUOTA}:carol:quota=3000,{FREE}:dave"
LIMIT = 3000
MODEL = "gpt-4o-mini"
# About 1,000 tokens of answer: what each of the requests was billed.
ANSWER = "the quick brown fox jumps over the lazy dog " * 120
BILLED = {"prompt_tokens": 50, "completion_tokens": 1000, "total_tokens": 1050}


@pytest.fixture
def served(start_proxy: Starter) -> RunningProxy:
    return start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN)


def carol(proxy: RunningProxy) -> dict[str, int]:
    """carol's month, summed over her rows (the admin API writes pending counts first)."""
    with httpx.Client(base_url=proxy.url, timeout=20) as http:
        report = http.get("/v1/admin/usage", params={"user": "carol"},
                          headers={"Authorization": f"Bearer {ADMIN}"})
    assert report.status_code == 200, report.text
    totals: dict[str, int] = report.json()["totals"]
    return totals


def spent(proxy: RunningProxy) -> int:
    month = carol(proxy)
    return month["input_tokens"] + month["output_tokens"]


def post_chat(proxy: RunningProxy, key: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **extra}
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        return http.post("/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"})


def sdk(proxy: RunningProxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0, timeout=30)


# -- item 3: every path counts what the upstream bills ------------------------------------


def test_streams_cut_before_their_usage_chunk_are_counted_from_what_was_relayed(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    """The issue's attack: each stream is cut after its last text chunk, before the usage
    chunk. Counted as 0, eight answers went through; counted from the text relayed (and the
    prompt sent), the fourth is refused."""
    chunks = chat_chunks(ANSWER, include_usage=True, prompt_tokens=50)
    assert not chunks[-1]["choices"]  # the usage chunk, which never arrives
    admitted = 0
    for _ in range(8):
        # Paced, so each event is relayed before the connection drops.
        upstream.enqueue(SSEReply(chunks, cut_after=len(chunks) - 1, delay=0.02))
        answer = post_chat(served, QUOTA, stream=True)
        if answer.status_code == 429:
            assert answer.json()["error"]["code"] == "token_quota_exceeded"
            break
        assert answer.status_code == 200 and "fox jumps" in answer.text
        admitted += 1
    assert admitted == 3  # 3 x ~1,000 tokens reach the quota; the fourth is refused
    month = carol(served)
    assert month["output_tokens"] == 3 * count_tokens(ANSWER, MODEL)
    assert month["input_tokens"] > 0
    upstream.clear()


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_responses_and_messages_streams_cut_before_their_usage_count_the_text(
    start_proxy: Starter, upstream: ScriptedUpstream, api: str
) -> None:
    """The same cut on the other formats: a Responses stream before `response.completed`,
    a Messages stream after `message_start` (its input) and before `message_delta` (its
    output)."""
    proxy = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN,
                        anthropic_base_url=upstream.base_url.removesuffix("/v1"))
    if api == "responses":
        events = response_events(ANSWER, input_tokens=40)
        cut, body = len(events) - 1, {"model": MODEL, "input": "hello", "stream": True}
    else:
        events = message_events(ANSWER, input_tokens=40)
        cut = next(i for i, e in enumerate(events) if b"message_delta" in e)
        body = {"model": "claude-x", "max_tokens": 2000, "stream": True,
                "messages": [{"role": "user", "content": "hello"}]}
    upstream.enqueue(SSEReply(events, cut_after=cut, delay=0.02, done=False))
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        answer = http.post(f"/v1/{api}", json=body, headers={"Authorization": f"Bearer {QUOTA}"})
    assert answer.status_code == 200 and "fox jumps" in answer.text
    month = carol(proxy)
    assert month["output_tokens"] == count_tokens(ANSWER, MODEL)
    assert month["input_tokens"] == 40 if api == "messages" else month["input_tokens"] > 0


def test_streamed_legacy_completions_are_counted_through_the_pass_through(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    """The scripted upstream sends no usage in a completion stream: memproxy asks for it,
    and counts the prompt and the text it relayed when none comes."""
    prompt = "write a haiku about quotas"
    with sdk(served, QUOTA) as client:
        stream = client.completions.create(model="gpt-3.5-turbo-instruct", prompt=prompt,
                                           stream=True)
        text = "".join(choice.text for chunk in stream for choice in chunk.choices)
    assert text == "echo: " + prompt
    assert upstream.history[-1].json["stream_options"] == {"include_usage": True}
    month = carol(served)
    assert month["input_tokens"] == count_tokens(prompt, "gpt-3.5-turbo-instruct")
    assert month["output_tokens"] == count_tokens(text, "gpt-3.5-turbo-instruct")


def test_a_completion_streams_usage_chunk_is_counted_and_stripped(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    events = [
        {**base, "choices": [{"text": "hi", "index": 0, "logprobs": None, "finish_reason": None}]},
        {**base, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}]},
        {**base, "choices": [], "usage": {"prompt_tokens": 700, "completion_tokens": 900,
                                          "total_tokens": 1600}},
    ]
    upstream.enqueue(SSEReply(events))
    with httpx.Client(base_url=served.url, timeout=20) as http:
        answer = http.post("/v1/completions", headers={"Authorization": f"Bearer {QUOTA}"},
                           json={"model": "m", "prompt": "p", "stream": True})
    assert answer.status_code == 200
    assert '"usage"' not in answer.text and "[DONE]" in answer.text  # not asked: not shown
    month = carol(served)
    assert (month["input_tokens"], month["output_tokens"]) == (700, 900)
    # 1,600 of 3,000: one more is admitted, and the key is then spent.
    upstream.enqueue(SSEReply(events))
    with httpx.Client(base_url=served.url, timeout=20) as http:
        assert http.post("/v1/completions", headers={"Authorization": f"Bearer {QUOTA}"},
                         json={"model": "m", "prompt": "p", "stream": True}).status_code == 200
        refused = http.post("/v1/completions", headers={"Authorization": f"Bearer {QUOTA}"},
                            json={"model": "m", "prompt": "p", "stream": True})
    assert refused.status_code == 429


def test_background_responses_are_refused_on_a_quota_key(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    """A background response runs after its request ended: its tokens never pass memproxy,
    so a quota key may not ask for one. A key without a quota may."""
    sent = len(upstream.history)
    with sdk(served, QUOTA) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="a long essay", background=True)
    error = refused.value.response.json()["error"]
    assert error["code"] == "unmetered_on_quota_key" and error["param"] == "background"
    assert error["type"] == "invalid_request_error" and "quota" in error["message"]
    assert len(upstream.history) == sent
    with sdk(served, QUOTA) as client:  # the same request in the foreground is counted
        client.responses.create(model=MODEL, input="a long essay", background=False)
    with sdk(served, FREE) as client:
        client.responses.create(model=MODEL, input="a long essay", background=True)
    assert upstream.history[-1].json["background"] is True
    assert carol(served)["input_tokens"] > 0


@pytest.mark.parametrize("path", [
    "/v1/batches", "/v1/fine_tuning/jobs", "/v1/images/generations", "/v1/audio/speech",
    "/v1/realtime/sessions", "/v1/vector_stores", "/v1/threads/runs", "/v1//batches",
    "/v1/Batches",
])
def test_unmetered_upstream_work_is_refused_on_a_quota_key(
    served: RunningProxy, upstream: ScriptedUpstream, path: str
) -> None:
    sent = len(upstream.history)
    with httpx.Client(base_url=served.url, timeout=20) as http:
        refused = http.post(path, json={"input_file_id": "file-1", "model": "m"},
                            headers={"Authorization": f"Bearer {QUOTA}"})
        assert refused.status_code in (403, 404), refused.text
        assert len(upstream.history) == sent
        if refused.status_code == 403:
            error = refused.json()["error"]
            assert error["code"] == "unmetered_on_quota_key" and error["type"] == "permission_error"
        # Reads cost nothing, and a key without a quota goes through.
        assert http.get("/v1/batches", headers={"Authorization": f"Bearer {QUOTA}"}).status_code == 200
        assert http.post("/v1/batches", json={"input_file_id": "file-1"},
                         headers={"Authorization": f"Bearer {FREE}"}).status_code == 200


def test_free_pass_through_writes_stay_open_to_a_quota_key(served: RunningProxy) -> None:
    with httpx.Client(base_url=served.url, timeout=20) as http:
        for path in ("/v1/files", "/v1/moderations", "/v1/responses/resp_1/cancel"):
            answer = http.post(path, json={"input": "x"}, headers={"Authorization": f"Bearer {QUOTA}"})
            assert answer.status_code == 200, (path, answer.text)


# -- item 4: concurrent requests reserve their estimate --------------------------------------


def billed_slowly(req: Received) -> Reply:
    """Every chat answer billed 1,050 tokens, after half a second: requests overlap."""
    return JSONReply(chat_completion(ANSWER, usage=BILLED), delay=0.5)


def burst(proxies: list[RunningProxy], count: int) -> list[int]:
    """`count` chat requests at once, spread over `proxies`; their statuses."""
    def one(i: int) -> int:
        return post_chat(proxies[i % len(proxies)], QUOTA, max_tokens=1000).status_code

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def assert_bounded(proxies: list[RunningProxy], statuses: list[int]) -> None:
    admitted = statuses.count(200)
    assert statuses.count(429) == len(statuses) - admitted
    # docs/usage.md: the month may end over its quota by at most one request's tokens (its
    # prompt plus its max_tokens, the upstream's count of the prompt against memproxy's).
    assert 1 <= admitted <= 3, statuses
    assert spent(proxies[0]) == admitted * BILLED["total_tokens"]
    assert spent(proxies[0]) <= LIMIT + BILLED["total_tokens"]
    settings = proxies[0].state.settings
    # Every reservation was settled: none is left to hold the quota.
    assert scalar(settings, "SELECT COUNT(*) FROM usage_reservations") == 0


@pytest.mark.both_backends
def test_thirty_concurrent_requests_on_a_small_quota_overshoot_a_bounded_amount(
    start_proxy: Starter, upstream: ScriptedUpstream, backend: str
) -> None:
    """The issue's race: 30 requests at once on a 3,000-token quota were all admitted
    (31,500 tokens, 10.5 times the quota)."""
    proxy = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN)
    upstream.respond_with(billed_slowly)
    assert_bounded([proxy], burst([proxy], 30))


def test_thirty_concurrent_requests_over_two_replicas_share_one_quota(
    start_proxy: Starter, upstream: ScriptedUpstream, postgres_server: Any, tmp_path: Any
) -> None:
    url = postgres_server.create_database()
    first = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN, database_url=url)
    second = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN, database_url=url,
                         data_dir=tmp_path / "second")
    upstream.respond_with(billed_slowly)
    assert_bounded([first, second], burst([first, second], 30))


def test_a_reservation_left_by_a_dead_replica_lapses(
    start_proxy: Starter, upstream: ScriptedUpstream
) -> None:
    """A replica that died mid-request never settles: its row stops counting at its
    expiry, it does not hold the key's quota for good."""
    proxy = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN)
    settings = proxy.state.settings
    key_id = next(k.key_id for k in settings.api_keys if k.key == QUOTA)
    now = time.time()
    scalar(settings, "INSERT INTO usage_reservations (id, key_id, tokens, expires_at)"
           " VALUES ('dead', ?, 5000, ?) RETURNING 1", (key_id, now + 3600))
    refused = post_chat(proxy, QUOTA)
    assert refused.status_code == 429 and "5000 more held" in refused.json()["error"]["message"]
    scalar(settings, "UPDATE usage_reservations SET expires_at = ? WHERE id = 'dead'"
           " RETURNING 1", (now - 1,))
    assert post_chat(proxy, QUOTA).status_code == 200
    assert scalar(settings, "SELECT COUNT(*) FROM usage_reservations") == 0


def test_reservations_are_settled_when_the_client_goes_or_the_upstream_fails(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    """The settlement runs in the request's finally path: a client that hangs up mid-stream
    and an upstream error leave no reservation behind, and what was relayed is counted."""
    settings = served.state.settings
    upstream.enqueue(SSEReply(chat_chunks(ANSWER, split=40, include_usage=True), delay=0.05))
    with httpx.Client(base_url=served.url, timeout=30) as http, http.stream(
        "POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {QUOTA}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ) as answer:
        assert answer.status_code == 200
        seen = b""
        for part in answer.iter_bytes():
            seen += part
            if b"fox" in seen:
                break  # the client goes away after some of the text
    upstream.enqueue(ErrorReply(500, "the upstream broke"))
    assert post_chat(served, QUOTA).status_code == 500
    deadline = time.monotonic() + 5
    while scalar(settings, "SELECT COUNT(*) FROM usage_reservations") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scalar(settings, "SELECT COUNT(*) FROM usage_reservations") == 0
    month = carol(served)
    assert month["requests"] == 2 and month["errors"] == 1
    assert 0 < month["output_tokens"] < count_tokens(ANSWER, MODEL)  # the part relayed


# -- item 4: a key's rate limit holds across replicas ----------------------------------------


def test_a_keys_rate_limit_holds_across_two_replicas(
    start_proxy: Starter, postgres_server: Any, tmp_path: Any
) -> None:
    """With its own bucket per replica a key got N times its rate; the bucket lives in the
    database now. 6 a minute: 12 requests over two replicas get 6 through (7 if the bucket
    refilled one while they ran)."""
    url = postgres_server.create_database()
    replicas = [
        start_proxy(memory=True, api_keys=KEYS, database_url=url, rate_limit=6),
        start_proxy(memory=True, api_keys=KEYS, database_url=url, rate_limit=6,
                    data_dir=tmp_path / "second"),
    ]
    started = time.monotonic()
    statuses = []
    for i in range(12):
        with httpx.Client(base_url=replicas[i % 2].url, timeout=20) as http:
            answer = http.get("/v1/models", headers={"Authorization": f"Bearer {FREE}"})
        statuses.append(answer.status_code)
        if answer.status_code == 429:
            assert answer.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(answer.headers["retry-after"]) >= 1
    refills = int((time.monotonic() - started) * 6 / 60)
    assert 6 <= statuses.count(200) <= 6 + refills + 1, statuses
    assert statuses[:6] == [200] * 6
