"""Tokens spent through the pass-through (docs/usage.md): /v1/embeddings and /v1/completions
replies are relayed untouched and read on their way for their `usage`, so a key's quota
counts them; other pass-through paths count requests only. Real server, the official SDK,
the scripted upstream."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.formats.usage import ReplyUsage, Seen
from tests.conftest import RunningProxy
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream
from tests.test_usage import ADMIN, ALICE, KEYS, QUOTA, Starter, key_id, row, sdk, usage_of


@pytest.fixture
def served(start_proxy: Starter) -> RunningProxy:
    return start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN)


def test_embeddings_and_completions_spend_the_tokens_their_replies_say(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    with sdk(served, ALICE) as client:
        small = client.embeddings.create(model="text-embedding-3-small", input="a short one")
        # Megabytes of vectors: the usage is read from the reply's last bytes.
        big = client.embeddings.create(model="text-embedding-3-small", dimensions=3072,
                                       input=[f"text number {i} with some words" for i in range(40)])
        assert len(big.data) == 40 and len(big.data[0].embedding) == 3072
        completion = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="say hello")
        assert completion.choices[0].text == "echo: say hello"
        models = client.models.list()
        assert models.data
    sent = {(r.method, r.path): r.headers for r in upstream.history}
    # Read replies come plain (as chat replies do); the rest keep the client's encodings.
    assert sent[("POST", "/v1/embeddings")]["accept-encoding"] == "identity"
    assert sent[("POST", "/v1/completions")]["accept-encoding"] == "identity"
    assert sent[("GET", "/v1/models")]["accept-encoding"] != "identity"

    assert completion.usage is not None
    alice = row(usage_of(served, key_id=key_id(served, ALICE)), key_id(served, ALICE), "alice")
    assert alice["requests"] == 4 and alice["errors"] == 0
    assert alice["input_tokens"] == small.usage.prompt_tokens + big.usage.prompt_tokens \
        + completion.usage.prompt_tokens
    assert alice["output_tokens"] == completion.usage.completion_tokens > 0


FAKE = '"usage": {"prompt_tokens": 0, "completion_tokens": 0}'
USAGE = {"prompt_tokens": 40, "completion_tokens": 30, "total_tokens": 70,
         "completion_tokens_details": {"reasoning_tokens": 12}}


@pytest.mark.parametrize("reply", [
    # What a model wrote cannot pass for the usage, even after it: a quote inside a JSON
    # string is escaped, so the text holds no `"usage"` key.
    {"usage": USAGE, "id": "cmpl-1", "object": "text_completion", "model": "m",
     "choices": [{"text": FAKE, "index": 0}]},
    # The same in a reply too long to keep whole: its first bytes hold the usage.
    {"usage": USAGE, "id": "cmpl-2", "object": "text_completion", "model": "m",
     "choices": [{"text": "x" * 40_000 + FAKE, "index": 0}]},
    # The usual order: the usage last.
    {"id": "cmpl-3", "object": "text_completion", "model": "m",
     "choices": [{"text": FAKE, "index": 0}], "usage": USAGE},
], ids=["text after the usage", "long text after the usage", "usage last"])
def test_a_quota_counts_what_the_pass_through_spent(
    served: RunningProxy, upstream: ScriptedUpstream, reply: dict[str, Any]
) -> None:
    """The attack: a key with a token quota spending without limit through /v1/completions
    (or /v1/embeddings), which were counted as requests only."""
    upstream.enqueue(JSONReply(reply), path="/v1/completions")
    with sdk(served, QUOTA) as client:
        client.completions.create(model="m", prompt='"usage": {"prompt_tokens": 0}')
        upstream.enqueue(JSONReply(reply), path="/v1/completions")
        client.completions.create(model="m", prompt="more")  # 140 of 100 spent now
        sent = len(upstream.history)
        with pytest.raises(openai.RateLimitError) as refused:
            client.embeddings.create(model="text-embedding-3-small", input="and more")
    assert refused.value.response.json()["error"]["code"] == "token_quota_exceeded"
    assert "140 of 100 tokens" in refused.value.response.json()["error"]["message"]
    assert len(upstream.history) == sent
    carol = row(usage_of(served, user="carol"), key_id(served, QUOTA), "carol")
    assert (carol["input_tokens"], carol["output_tokens"], carol["errors"]) == (80, 60, 1)


def test_a_reply_without_usage_counts_its_prompt_and_an_error_none(
    served: RunningProxy, upstream: ScriptedUpstream
) -> None:
    """The upstream bills an embedding whether or not its reply says so: memproxy counts the
    input it sent with the model's tokenizer ("x": 1 token; docs/usage.md)."""
    upstream.enqueue(JSONReply({"object": "list", "data": []}), path="/v1/embeddings")
    upstream.enqueue(JSONReply({"error": {"message": "no", "type": "invalid_request_error"}},
                               status=400), path="/v1/completions")
    with httpx.Client(base_url=served.url, timeout=20,
                      headers={"Authorization": f"Bearer {ALICE}"}) as http:
        assert http.post("/v1/embeddings", json={"model": "e", "input": "x"}).status_code == 200
        assert http.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 400
    alice = row(usage_of(served, key_id=key_id(served, ALICE)), key_id(served, ALICE), "alice")
    assert (alice["requests"], alice["errors"], alice["input_tokens"], alice["output_tokens"]) \
        == (2, 1, 1, 0)


@pytest.mark.parametrize("filler", [0, 8_150, 12_000, 100_000])
def test_the_usage_is_read_wherever_the_reads_split_the_reply(filler: int) -> None:
    # Around 8 KiB the usage straddles what is kept of the start and of the end.
    body = orjson.dumps({"object": "list", "data": "x" * filler, "model": "m",
                         "usage": {"prompt_tokens": 17, "total_tokens": 17}})
    for size in (1, 1000, 4096, len(body)):
        reader = ReplyUsage()
        for at in range(0, len(body), size):
            reader.feed(body[at:at + size])
        assert reader.seen() == Seen(17, None), (filler, size)
