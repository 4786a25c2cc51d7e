"""One shared upstream key, and what a caller may reach through it (security review, item 6).

- A `previous_response_id` memproxy stored for another user is refused with the 404 the
  upstream gives for an id it does not know, memory on or off for the request; so is
  GET/DELETE /v1/responses/{id} (and its /input_items). An id memproxy never stored still
  goes to the upstream.
- A pass-through path never leaves /v1 on the upstream, however it is spelled.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator

import httpx
import openai
import orjson
import pytest

from tests.conftest import RunningProxy
from tests.support.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.both_backends

KEYS = "key-ada-0000001:ada,key-bob-0000001:bob"
ADA, BOB = "key-ada-0000001", "key-bob-0000001"


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True, api_keys=KEYS, upstream_api_key="sk-operator")


@pytest.fixture
def sdk(memproxy: RunningProxy) -> Iterator[Callable[..., openai.OpenAI]]:
    made: list[openai.OpenAI] = []

    def make(key: str, **headers: str) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=memproxy.base_url, api_key=key, max_retries=0,
                                  default_headers=headers))
        return made[-1]

    yield make
    for client in made:
        client.close()


def not_found(reply: httpx.Response, message: str, param: str | None, code: str | None) -> None:
    """The 404 OpenAI gives for an id it does not know, nothing more."""
    assert reply.status_code == 404, reply.text
    assert reply.json() == {"error": {"message": message, "type": "invalid_request_error",
                                      "param": param, "code": code}}


def test_another_users_previous_response_id_is_not_found(
    memproxy: RunningProxy, upstream: ScriptedUpstream, sdk: Callable[..., openai.OpenAI]
) -> None:
    ada = sdk(ADA).responses.create(model="gpt-4o-mini", input="My locker code is 4512.")
    sent = len(upstream.history)
    with httpx.Client(base_url=memproxy.url, timeout=20) as http:
        for stream in (False, True):
            for headers in ({}, {"X-Memory": "off"}, {"X-Memory-Read": "off"}, {"X-Memory-Dry-Run": "on"}):
                reply = http.post("/v1/responses", headers={"authorization": f"Bearer {BOB}", **headers},
                                  json={"model": "gpt-4o-mini", "input": "What was it again?",
                                        "previous_response_id": ada.id, "stream": stream})
                not_found(reply, f"Previous response with id '{ada.id}' not found.",
                          "previous_response_id", "previous_response_not_found")
        # The SDK reads it as the upstream's own answer.
        with pytest.raises(openai.NotFoundError):
            sdk(BOB).responses.create(model="gpt-4o-mini", input="x", previous_response_id=ada.id)
        assert len(upstream.history) == sent  # none of it went upstream

        # Bob stores a reply under Ada's id (a chat request naming it in X-Request-Id): the id
        # is still Ada's, for both of them.
        assert http.post("/v1/chat/completions", headers={
            "authorization": f"Bearer {BOB}", "x-request-id": ada.id,
        }, json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        reply = http.post("/v1/responses", headers={"authorization": f"Bearer {BOB}"}, json={
            "model": "gpt-4o-mini", "input": "x", "previous_response_id": ada.id})
        assert reply.status_code == 404, reply.text

    # Ada goes on from her own reply; an id memproxy never stored goes to the upstream.
    again = sdk(ADA).responses.create(model="gpt-4o-mini", input="And?", previous_response_id=ada.id)
    assert again.output_text == "echo: And?"
    assert upstream.history[-1].json["previous_response_id"] == ada.id
    sdk(BOB).responses.create(model="gpt-4o-mini", input="x", previous_response_id="resp_never_seen")
    assert upstream.history[-1].json["previous_response_id"] == "resp_never_seen"


def test_another_users_response_is_not_found_by_id(
    memproxy: RunningProxy, upstream: ScriptedUpstream, sdk: Callable[..., openai.OpenAI]
) -> None:
    ada = sdk(ADA).responses.create(model="gpt-4o-mini", input="My locker code is 4512.")
    sent = len(upstream.history)
    with httpx.Client(base_url=memproxy.url, timeout=20) as http:
        for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")):
            for spelled in (ada.id, ada.id.replace("resp_", "resp%5F")):
                reply = http.request(method, f"/v1/responses/{spelled}{path}",
                                     headers={"authorization": f"Bearer {BOB}"})
                not_found(reply, f"Response with id '{ada.id}' not found.", None, None)
        assert len(upstream.history) == sent
        # Her own and an unknown id go to the upstream; the account's files are refused to a
        # key bound to a user (tests/security/test_stored_objects.py).
        for key, path in ((ADA, f"/v1/responses/{ada.id}"), (BOB, "/v1/responses/resp_never_seen")):
            http.get(path, headers={"authorization": f"Bearer {key}"})
            assert upstream.history[-1].path == path
            assert upstream.history[-1].headers["authorization"] == "Bearer sk-operator"
        assert http.get("/v1/files", headers={"authorization": f"Bearer {BOB}"}).status_code == 403


TRAVERSALS = [
    "/v1/../../admin/x", "/v1/../admin", "/v1/models/../../admin", "/v1/./../admin",
    "/v1/%2e%2e/%2e%2e/admin/x", "/v1/%2E%2E/admin", "/v1/.%2e/admin", "/v1/%2e./admin",
    "/v1/models%2f..%2f..%2fadmin", "/v1/models%2F%2E%2E%2F%2E%2E%2Fadmin", "/v1%2f..%2fadmin",
    "/v1/%252e%252e/%252e%252e/admin", "/v1/%25252e%25252e/admin", "/v1/..%5cadmin",
    "/v1/..\\admin", "/v1/models\\..\\..\\admin", "/v1/..;/admin", "/v1/%2e%2e;x/admin",
    "/v1/files/%00/../admin",
]


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_a_path_never_leaves_v1_on_the_upstream(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, method: str
) -> None:
    proxy = start_proxy(upstream_api_key="sk-operator")
    reached = []
    for path in TRAVERSALS:
        # http.client sends the path as it is (curl --path-as-is); httpx would resolve it.
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
        try:
            conn.request(method, path, body=b"{}" if method == "POST" else None,
                         headers={"content-type": "application/json"})
            reply = conn.getresponse()
            status, body = reply.status, reply.read()
        finally:
            conn.close()
        if upstream.history:
            reached.append((path, [r.path for r in upstream.history]))
            break
        assert status in (400, 404), (path, status, body)
        if status == 404:  # memproxy's answer, in OpenAI's envelope (400s may be uvicorn's)
            assert orjson.loads(body)["error"]["type"] == "invalid_request_error", (path, body)
    assert reached == []
    # An ordinary path still goes through, as sent.
    assert httpx.get(f"{proxy.base_url}/models/gpt-4o-mini", timeout=20).status_code == 200
    assert upstream.history[-1].path == "/v1/models/gpt-4o-mini"
