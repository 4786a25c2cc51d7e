"""What a quota key's request reserves (proxy/access/quota.py, docs/usage.md "Reservations"):
the prompt by the model's tokenizer, the output it may ask for, and the refusals of work
memproxy cannot count."""

from __future__ import annotations

import pytest

from config import ApiKey
from memory.tokens import count_tokens
from proxy.access.quota import (
    COMPLETION_DEFAULT_OUTPUT,
    DEFAULT_OUTPUT_TOKENS,
    MESSAGE_OVERHEAD,
    estimate,
    output_allowance,
    prompt_tokens,
    refuse_unmetered,
    refuse_unmetered_path,
)
from proxy.http.errors import InvalidRequest, PermissionDenied

MODEL = "gpt-4o-mini"


def test_the_prompt_is_every_text_with_the_tokenizer_and_each_messages_overhead() -> None:
    body = {"model": MODEL, "max_tokens": 77, "temperature": 1, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
    ]}
    texts = "\n".join(["system", "be brief", "user", "text", "hello there"])
    assert prompt_tokens(body, MODEL, raw_size=100) == count_tokens(texts, MODEL) + 2 * MESSAGE_OVERHEAD


def test_a_token_id_prompt_counts_one_per_id_and_a_huge_body_by_its_bytes() -> None:
    assert prompt_tokens({"model": "m", "prompt": [[1, 2, 3], [4, 5]]}, "m", raw_size=40) == 5
    assert prompt_tokens({"prompt": "x"}, "m", raw_size=8 * 1024 * 1024) == 2 * 1024 * 1024


@pytest.mark.parametrize(("body", "route", "allowed"), [
    ({"max_tokens": 50}, "chat", 50),
    ({"max_completion_tokens": 60, "max_tokens": 50}, "chat", 60),
    ({"max_output_tokens": 70}, "responses", 70),
    ({"max_tokens": 50, "n": 3}, "chat", 150),
    ({}, "chat", DEFAULT_OUTPUT_TOKENS),
    ({"max_tokens": -5}, "chat", DEFAULT_OUTPUT_TOKENS),
    ({"max_tokens": True}, "chat", DEFAULT_OUTPUT_TOKENS),
    ({}, "/v1/completions", COMPLETION_DEFAULT_OUTPUT),
    ({"max_tokens": 9}, "/v1/embeddings", 0),
])
def test_the_output_a_request_may_ask_for(body: dict[str, object], route: str, allowed: int) -> None:
    assert output_allowance(body, route) == allowed


def test_the_estimate_adds_the_memory_block() -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 10}
    bare = estimate(body, MODEL, raw_size=50, route="responses")
    assert estimate(body, MODEL, raw_size=50, route="responses", memory_tokens=400) == bare + 400


def test_only_a_quota_key_is_refused_unmetered_work() -> None:
    quota, free = ApiKey("k-quota-00001", token_quota=10), ApiKey("k-free-000001")
    with pytest.raises(InvalidRequest) as caught:
        refuse_unmetered(quota, "responses", {"background": True})
    assert caught.value.param == "background" and caught.value.code == "unmetered_on_quota_key"
    refuse_unmetered(quota, "responses", {"background": False})
    refuse_unmetered(free, "responses", {"background": True})
    refuse_unmetered(None, "responses", {"background": True})
    with pytest.raises(PermissionDenied):
        refuse_unmetered_path(quota, "POST", "/v1/batches")
    for method, path in (("GET", "/v1/batches"), ("DELETE", "/v1/files/f1"),
                         ("POST", "/v1/embeddings"), ("POST", "/v1/uploads/u1/parts")):
        refuse_unmetered_path(quota, method, path)
    refuse_unmetered_path(free, "POST", "/v1/batches")
