"""What the upstream keeps on the operator's shared key, and whose it is (issue 37, items 5
and 13), on both backends.

Item 5: with `store: true` the upstream keeps chat completions; bob's key must not list
alice's, read their messages (which hold memproxy's memory block), change or delete them.
memproxy remembers each reply under the upstream's id, so an id it stored for another user
is the upstream's own 404; the list, and the account's objects whose owner memproxy cannot
know (files, batches, vector stores, ...), are refused to a key bound to a user or an
organisation (unbound keys, and MEMPROXY_SHARED_ACCOUNT_OBJECTS=on, pass them through).
Item 13: the path is made one spelling before routing and ownership read it, so a doubled
slash, a `.` segment, a trailing slash or an encoded slash reaches the same check.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningProxy
from tests.support.memory import QUIET, db_rows
from tests.support.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.both_backends

ALICE, BOB, APP, ORG = "key-alice-000001", "key-bob-0000001", "key-app-0000001", "key-org-0000001"
KEYS = f"{ALICE}:alice,{BOB}:bob,{APP},{ORG}:org=acme"
PIN = "My PIN is 4512."


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True, api_keys=KEYS, upstream_api_key="sk-operator", **QUIET)


@pytest.fixture
def alice(memproxy: RunningProxy) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=memproxy.base_url, api_key=ALICE, max_retries=0) as client:
        yield client


def raw(proxy: RunningProxy, method: str, path: str, key: str, body: bytes | None = None
        ) -> tuple[int, bytes]:
    """A request whose path goes as written (http.client; httpx would tidy it)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={
            "authorization": f"Bearer {key}", "content-type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def stored_for(proxy: RunningProxy, object_id: str, user: str) -> None:
    """Wait until memproxy has remembered the reply `object_id` for `user`."""
    deadline = time.monotonic() + 20
    sql = "SELECT user_id FROM turns WHERE request_id = ? AND role = 'assistant'"
    while time.monotonic() < deadline:
        if [row[0] for row in db_rows(proxy, sql, (object_id,))] == [user]:
            return
        time.sleep(0.05)
    raise AssertionError(f"{object_id} was not stored for {user}")


def spellings(path: str) -> list[str]:
    """`path` (under /v1/) as a client or a gateway in front might spell it."""
    rest = path.removeprefix("/v1/")
    return [path, f"/v1//{rest}", f"//v1/{rest}", f"/v1/./{rest}", f"{path}/", f"{path}//",
            f"/v1/{rest.replace('/', '//')}", f"/v1/%2e/{rest}", f"/v1/{rest.replace('/', '/./')}",
            f"/v1/{rest.replace('/', '%2F', 1)}"]


@pytest.mark.parametrize("stream", [False, True])
def test_another_users_stored_completion_is_not_found(
    memproxy: RunningProxy, upstream: ScriptedUpstream, alice: openai.OpenAI, stream: bool,
) -> None:
    if stream:
        chunks = list(alice.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": PIN}], store=True,
            stream=True))
        completion_id = chunks[0].id
    else:
        completion_id = alice.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": PIN}], store=True).id
    stored_for(memproxy, completion_id, "alice")
    sent = len(upstream.history)
    for method, tail, body in (("GET", "", None), ("GET", "/messages", None),
                               ("POST", "", b'{"metadata": {"k": "v"}}'), ("DELETE", "", None)):
        for path in spellings(f"/v1/chat/completions/{completion_id}{tail}"):
            status, answer = raw(memproxy, method, path, BOB, body)
            assert status == 404, (method, path, answer)
            assert b"not found" in answer, answer
    assert len(upstream.history) == sent  # none of it reached the upstream
    # Alice reads her own.
    status, _ = raw(memproxy, "GET", f"/v1//chat/completions/{completion_id}/messages", ALICE)
    assert status == 200
    assert upstream.history[-1].path == f"/v1/chat/completions/{completion_id}/messages"


def test_another_users_response_input_is_not_found_however_spelled(
    memproxy: RunningProxy, upstream: ScriptedUpstream, alice: openai.OpenAI,
) -> None:
    response_id = alice.responses.create(model="gpt-4o-mini", input=PIN).id
    stored_for(memproxy, response_id, "alice")
    sent = len(upstream.history)
    for method, tail in (("GET", "/input_items"), ("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
        for path in spellings(f"/v1/responses/{response_id}{tail}"):
            status, answer = raw(memproxy, method, path, BOB)
            assert status == 404, (method, path, answer)
    assert len(upstream.history) == sent
    # What goes upstream is the path memproxy checked, in its one spelling.
    assert raw(memproxy, "GET", f"/v1//responses/{response_id}/input_items/", ALICE)[0] == 200
    assert upstream.history[-1].path == f"/v1/responses/{response_id}/input_items"


# The account's objects whose owner memproxy cannot know: (method, path).
ACCOUNT_OBJECTS: list[tuple[str, str]] = [
    ("GET", "/v1/chat/completions"), ("GET", "/v1/chat/completions?limit=100&order=desc"),
    ("GET", "/v1/chat/completions/"), ("GET", "//v1/chat/completions"),
    ("GET", "/v1/files"), ("GET", "/v1/files/file-abc/content"), ("POST", "/v1/files"),
    ("DELETE", "/v1/files/file-abc"), ("GET", "/v1/batches"), ("POST", "/v1/batches"),
    ("GET", "/v1/vector_stores"), ("GET", "/v1/assistants"), ("GET", "/v1/threads/t/messages"),
    ("GET", "/v1/conversations/c/items"), ("GET", "/v1/fine_tuning/jobs"),
    ("DELETE", "/v1/models/ft:gpt-4o-mini:acme::x"), ("GET", "/v1/uploads"),
    ("GET", "/v1/Files"), ("GET", "/v1/something_new"),
]


@pytest.mark.parametrize("key", [BOB, ORG])
def test_a_confined_key_reaches_no_account_object(
    memproxy: RunningProxy, upstream: ScriptedUpstream, key: str,
) -> None:
    for method, path in ACCOUNT_OBJECTS:
        status, answer = raw(memproxy, method, path, key, b"{}" if method == "POST" else None)
        assert status == 403, (method, path, answer)
        assert b"permission_error" in answer
    assert upstream.history == []
    # What keeps nothing on the account still passes.
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/gpt-4o-mini"),
                         ("POST", "/v1/embeddings")):
        body = b'{"model": "text-embedding-3-small", "input": "x"}' if method == "POST" else None
        status, answer = raw(memproxy, method, path, key, body)
        assert status == 200, (path, answer)
        assert upstream.history[-1].headers["authorization"] == "Bearer sk-operator"


def test_an_unbound_key_and_a_shared_account_reach_account_objects(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    plain = start_proxy(memory=True, api_keys=KEYS, upstream_api_key="sk-operator", **QUIET)
    for path in ("/v1/files", "/v1/chat/completions", "/v1/batches"):
        assert raw(plain, "GET", path, APP)[0] == 200, path
        assert upstream.history[-1].path == path
    shared = start_proxy(memory=True, api_keys=KEYS, upstream_api_key="sk-operator",
                         shared_account_objects=True,
                         data_dir=plain.state.settings.data_dir.parent / "shared", **QUIET)
    assert raw(shared, "GET", "/v1/files", BOB)[0] == 200
    # The list holds every user's completions: refused to bob even then.
    assert raw(shared, "GET", "/v1/chat/completions", BOB)[0] == 403


def test_a_clients_own_key_reaches_its_own_account(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    """No upstream key: the client's own key goes upstream, so the account is its own."""
    byok = start_proxy(memory=True, **QUIET)
    headers: dict[str, Any] = {"authorization": "Bearer sk-client-own"}
    for path in ("/v1/files", "/v1/chat/completions"):
        assert httpx.get(f"{byok.url}{path}", headers=headers, timeout=30).status_code == 200
        assert upstream.history[-1].headers["authorization"] == "Bearer sk-client-own"
