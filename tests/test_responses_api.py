"""POST /v1/responses with memory, through the official openai SDK and the scripted upstream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningProxy
from tests.support.formats import response_events, response_object
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import Drop, JSONReply, RawReply, ScriptedUpstream, SSEReply
from tests.support.sql import query

pytestmark = pytest.mark.both_backends

ADA = {"X-Memory-User-Id": "ada"}


Sdk = Callable[..., openai.OpenAI]


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    """Make openai clients aimed at a proxy: sdk(proxy, **headers); closed after the test."""
    made: list[openai.OpenAI] = []

    def make(proxy: RunningProxy, **headers: str) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=proxy.base_url, api_key="sk-test", max_retries=0,
                                  default_headers=headers))
        return made[-1]

    yield make
    for client in made:
        client.close()


def turns(proxy: RunningProxy, user: str = "ada") -> list[tuple[str, str, str, int]]:
    return query(proxy.state.settings, "SELECT session_id, role, content, incomplete FROM turns"
                 " WHERE user_id = ? ORDER BY id", (user,))


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True)


def test_create_relays_the_body_untouched_without_memory(
    proxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    raw = b'{"model":"gpt-4o-mini","input":[{"role":"user","content":[{"type":"input_text","text":"hi"},{"type":"input_image","image_url":"data:image/png;base64,AAAA"}]},{"type":"function_call_output","call_id":"c1","output":"42"}],"store":false}'
    reply = httpx.post(f"{proxy.base_url}/responses", content=raw,
                       headers={"content-type": "application/json"}, timeout=20)
    assert reply.status_code == 200, reply.text
    assert upstream.history[-1].body == raw and upstream.history[-1].path == "/v1/responses"
    assert reply.json()["object"] == "response"
    assert reply.headers["x-memory-session-id"].startswith("fp-")


def test_sdk_create_and_stream(memproxy: RunningProxy, upstream: ScriptedUpstream, sdk: Sdk) -> None:
    client = sdk(memproxy, **ADA)
    response = client.responses.create(model="gpt-4o-mini", input="My cat is called Miso.")
    assert response.output_text == "echo: My cat is called Miso."
    with client.responses.stream(model="gpt-4o-mini", input="And my dog is Rex.",
                                 instructions="Be brief.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "echo: And my dog is Rex."
    wait_for_jobs(memproxy)
    stored = [(role, content, incomplete) for _, role, content, incomplete in turns(memproxy)]
    assert stored == [
        ("user", "My cat is called Miso.", 0), ("assistant", "echo: My cat is called Miso.", 0),
        ("user", "And my dog is Rex.", 0), ("assistant", "echo: And my dog is Rex.", 0),
    ]


def test_stream_is_relayed_byte_for_byte(memproxy: RunningProxy, upstream: ScriptedUpstream) -> None:
    events = response_events("Hello there, friend", split=4)
    upstream.enqueue(SSEReply(events, done=False), path="/v1/responses")
    with httpx.stream("POST", f"{memproxy.base_url}/responses", headers=ADA, timeout=20,
                      json={"model": "gpt-4o-mini", "input": "hi", "stream": True}) as reply:
        body = b"".join(reply.iter_raw())
    assert body == b"".join(events)
    wait_for_jobs(memproxy)
    assert turns(memproxy)[-1][1:] == ("assistant", "Hello there, friend", 0)


@pytest.mark.parametrize("placement", ["system", "last_user"])
def test_memory_goes_into_instructions_or_before_the_last_user_item(
    memproxy: RunningProxy, upstream: ScriptedUpstream, placement: str, sdk: Sdk
) -> None:
    client = sdk(memproxy, **ADA)
    client.chat.completions.create(model="gpt-4o", messages=[
        {"role": "user", "content": "The billing service runs on Postgres 16 with pgvector."}])
    wait_for_jobs(memproxy)
    items: list[Any] = [
        {"role": "user", "content": "hello"},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "nothing"},
        {"role": "user", "content": [{"type": "input_text", "text": "Which database does billing use?"}]},
    ]
    # Fresh injection: stable injection puts a block into `instructions` only in a
    # conversation's first request (tests/test_stable_injection.py).
    client.responses.create(model="gpt-4o-mini", input=items, instructions="Be brief.",
                            extra_headers={"X-Memory-Placement": placement,
                                           "X-Memory-Injection": "fresh"})
    sent = upstream.history[-1].json
    if placement == "system":
        assert sent["instructions"].startswith("Be brief.\n\n<memory>")
        assert "Postgres 16 with pgvector" in sent["instructions"]
        assert sent["input"] == items
    else:
        assert sent["instructions"] == "Be brief."
        assert sent["input"][:3] == items[:3] and sent["input"][4:] == items[3:]
        assert sent["input"][3]["role"] == "system"
        assert "Postgres 16 with pgvector" in sent["input"][3]["content"]


def test_previous_response_id_chains_store_each_turn_once_in_one_session(
    memproxy: RunningProxy, upstream: ScriptedUpstream, sdk: Sdk
) -> None:
    client = sdk(memproxy, **ADA)
    first = client.responses.with_raw_response.create(model="gpt-4o-mini", input="I live in Lisbon.")
    session = first.headers["x-memory-session-id"]
    second = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input=[{"role": "user", "content": "I work at Acme."}],
        previous_response_id=first.parse().id,
    )
    assert second.headers["x-memory-session-id"] == session
    # The same continuation again (a retry) stores nothing new.
    with client.responses.stream(model="gpt-4o-mini", input=[{"role": "user", "content": "I work at Acme."}],
                                 previous_response_id=first.parse().id) as stream:
        for _ in stream:
            pass
    third = client.responses.create(model="gpt-4o-mini", input="Where do I live?",
                                    previous_response_id=second.parse().id)
    wait_for_jobs(memproxy)
    stored = turns(memproxy)
    assert {s for s, *_ in stored} == {session}
    assert [content for _, _, content, _ in stored] == [
        "I live in Lisbon.", "echo: I live in Lisbon.", "I work at Acme.", "echo: I work at Acme.",
        "Where do I live?", third.output_text,
    ]
    # The chain is already in the model's context: recall does not send it back.
    assert "Lisbon" not in (upstream.history[-1].json.get("instructions") or "")


def test_a_stream_cut_midway_ends_with_one_responses_error_event(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(SSEReply(response_events("one two three four", split=4), cut_after=6, delay=0.05))
    with httpx.stream("POST", f"{memproxy.base_url}/responses", headers=ADA, timeout=20,
                      json={"model": "gpt-4o-mini", "input": "count", "stream": True}) as reply:
        body = b"".join(reply.iter_raw()).decode()
    events = body.strip().split("\n\n")
    assert events[-1].startswith("event: error\ndata: ")
    error = httpx.Response(200, content=events[-1].split("data: ", 1)[1]).json()
    assert error["type"] == "error" and error["code"] == "upstream_unreachable"
    assert error["sequence_number"] == 6 and error["message"]
    assert sum(e.startswith("event: error") for e in events) == 1
    wait_for_jobs(memproxy)
    assert turns(memproxy)[-1][1:] == ("assistant", "one two th", 1)  # kept, marked incomplete


def test_a_malformed_event_is_replaced_by_the_error_event(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    events = response_events("fine", split=1)
    upstream.enqueue(SSEReply([*events[:4], b"event: response.output_text.delta\ndata: {oops\n\n"],
                              done=False))
    with httpx.stream("POST", f"{memproxy.base_url}/responses", headers=ADA, timeout=20,
                      json={"model": "gpt-4o-mini", "input": "x", "stream": True}) as reply:
        body = b"".join(reply.iter_raw())
    assert body.startswith(b"".join(events[:4]))
    assert b"{oops" not in body and body.endswith(b"\n\n")
    assert b'"code":"upstream_invalid_response"' in body.rsplit(b"event: error", 1)[1]


@pytest.mark.parametrize(("body", "param"), [
    (b"{nope", None),
    (b'{"input": "hi"}', "model"),
    (b'{"model": "m", "input": 5}', "input"),
    (b'{"model": "m", "input": ["hi"]}', "input[0]"),
    (b'{"model": "m", "input": [{"role": "robot", "content": "x"}]}', "input[0].role"),
    (b'{"model": "m", "input": [{"role": "user", "content": 3}]}', "input[0].content"),
    (b'{"model": "m", "input": "x", "instructions": ["a"]}', "instructions"),
    (b'{"model": "m", "input": "x", "previous_response_id": 7}', "previous_response_id"),
    (b'{"model": "m", "input": "x", "stream": "yes"}', "stream"),
])
def test_malformed_bodies_get_a_400_in_openais_envelope_and_nothing_is_stored(
    memproxy: RunningProxy, upstream: ScriptedUpstream, body: bytes, param: str | None, sdk: Sdk
) -> None:
    client = sdk(memproxy, **ADA)
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", content=body, cast_to=httpx.Response,
                    options={"headers": {"content-type": "application/json"}})
    error = caught.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert upstream.history == [] and turns(memproxy) == []


def test_upstream_errors_and_bad_bodies_come_back_as_openai_errors(
    proxy: RunningProxy, upstream: ScriptedUpstream, sdk: Sdk
) -> None:
    client = sdk(proxy)
    upstream.enqueue(JSONReply({"error": {"message": "slow down", "type": "requests",
                                          "param": None, "code": None}}, status=429))
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model="gpt-4o-mini", input="x")
    upstream.enqueue(RawReply(b"<html>oops</html>", content_type="text/html"))
    with pytest.raises(openai.InternalServerError) as caught:
        client.responses.create(model="gpt-4o-mini", input="x")
    assert caught.value.status_code == 502
    upstream.enqueue(Drop(), Drop())  # a reused connection is tried once more
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="gpt-4o-mini", input="x")


def test_get_and_delete_of_a_response_pass_through(
    proxy: RunningProxy, upstream: ScriptedUpstream, sdk: Sdk
) -> None:
    client = sdk(proxy)
    upstream.enqueue(JSONReply(response_object("stored", response_id="resp_abc")))
    assert client.responses.retrieve("resp_abc").output_text == "stored"
    upstream.enqueue(JSONReply({"id": "resp_abc", "object": "response.deleted", "deleted": True}))
    client.responses.delete("resp_abc")
    assert [(r.method, r.path) for r in upstream.history] == [
        ("GET", "/v1/responses/resp_abc"), ("DELETE", "/v1/responses/resp_abc"),
    ]


def test_dry_run_returns_the_block_without_calling_the_upstream(
    memproxy: RunningProxy, upstream: ScriptedUpstream, sdk: Sdk
) -> None:
    client = sdk(memproxy, **ADA)
    client.responses.create(model="gpt-4o-mini", input="My favourite editor is Helix.")
    wait_for_jobs(memproxy)
    upstream.clear()
    reply = httpx.post(f"{memproxy.base_url}/responses", timeout=20,
                       headers={**ADA, "X-Memory-Dry-Run": "on", "X-Memory-Session-Id": "other"},
                       json={"model": "gpt-4o-mini", "input": "Which editor is my favourite?"})
    assert reply.json()["object"] == "memory.dry_run" and "Helix" in reply.json()["block"]
    assert upstream.history == []


def test_the_readme_python_example_runs(
    memproxy: RunningProxy, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("**Responses API**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-readme")
    namespace: dict[str, Any] = {}
    exec(example.replace("http://127.0.0.1:8080/v1", memproxy.base_url), namespace)
    namespace["client"].close()  # its pooled connection, not left to the garbage collector
    assert capsys.readouterr().out == "echo: Where do I live?\n"
    assert upstream.history[-1].json["previous_response_id"].startswith("resp_")
