"""Keys in the database (docs/keys.md): made, used, listed, changed and revoked through
/v1/admin/keys with the admin key, on both backends; MEMPROXY_AUTH=keys; environment keys
beside them. Attacks on the same surface are in tests/security/test_admin_keys.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from starlette.routing import Route

from proxy.cli.main import main
from proxy.management import admin_routes
from proxy.management.openapi import DOCUMENT
from tests.conftest import RunningProxy
from tests.support.memory import QUIET, assert_error, check_schema, db_rows
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream, chat_completion

pytestmark = pytest.mark.both_backends

ADMIN = "admin-key-000001"
ENV_KEYS = "env-key-alice-01:alice,env-key-acme-001:org=acme"


def admin(proxy: RunningProxy, key: str = ADMIN) -> httpx.Client:
    """A client of /v1/admin."""
    return httpx.Client(base_url=f"{proxy.url}/v1/admin",
                        headers={"Authorization": f"Bearer {key}"}, timeout=30)


def make_key(proxy: RunningProxy, **fields: Any) -> dict[str, Any]:
    """POST /v1/admin/keys; the created key with its secret."""
    with admin(proxy) as api:
        response = api.post("/keys", json={"user": "bob", **fields})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def ask(proxy: RunningProxy, key: str, text: str = "hello") -> str:
    """One chat completion through the openai SDK with `key`; the reply's text."""
    client = openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(model="gpt-4o-mini",
                                           messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


@pytest.fixture
def keyed(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    """Memory on, an admin key, two environment keys, and stored keys."""
    return start_proxy(memory=True, admin_key=ADMIN, api_keys=ENV_KEYS,
                       upstream_api_key="sk-upstream-0001", **QUIET)


@pytest.fixture
def strict(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    """MEMPROXY_AUTH=keys and no environment keys: only stored keys (and the admin's)."""
    return start_proxy(memory=True, admin_key=ADMIN, auth="keys",
                       upstream_api_key="sk-upstream-0001", **QUIET)


def test_a_created_key_chats_as_its_user_and_is_refused_once_revoked(
    keyed: RunningProxy, upstream: ScriptedUpstream,
) -> None:
    created = make_key(keyed)
    secret = created["key"]
    assert secret.startswith("mp-") and created["prefix"] == secret[: len(created["prefix"])]
    assert len(secret) >= 3 + 8 + 1 + 43  # 256 random bits in url-safe base64
    assert created["user"] == "bob" and created["status"] == "active"
    assert created["source"] == "database" and created["id"].startswith("key_")

    assert ask(keyed, secret)
    sent = upstream.history[-1]
    assert sent.headers["authorization"] == "Bearer sk-upstream-0001"  # never the mp- key
    assert db_rows(keyed, "SELECT DISTINCT user_id FROM turns") == [("bob",)]

    with admin(keyed) as api:
        revoked = api.delete(f"/keys/{created['id']}")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        ask(keyed, secret)


def test_the_list_shows_environment_and_stored_keys_and_no_secret(keyed: RunningProxy) -> None:
    created = make_key(keyed, org="acme", org_writer=True, rate_limit=600, token_quota=10_000)
    with admin(keyed) as api:
        listed = api.get("/keys")
        one = api.get(f"/keys/{created['id']}")
    assert listed.status_code == 200
    data = listed.json()["data"]
    env = [k for k in data if k["source"] == "env"]
    assert [(k["user"], k["org"]) for k in env] == [("alice", None), (None, "acme")]
    assert all(k["id"].startswith("env-") and k["prefix"] is None for k in env)
    stored = [k for k in data if k["source"] == "database"]
    assert stored == [one.json()]
    assert "key" not in one.json()
    assert {k: one.json()[k] for k in ("org", "org_writer", "rate_limit", "token_quota")} == {
        "org": "acme", "org_writer": True, "rate_limit": 600, "token_quota": 10_000}
    for text in (listed.text, one.text):
        assert created["key"] not in text and created["key"][12:] not in text
        assert "env-key-alice-01" not in text
    check_schema("ApiKeyList", listed.json())
    check_schema("ApiKey", one.json())


def test_patch_changes_a_key_and_null_clears_a_field(keyed: RunningProxy) -> None:
    created = make_key(keyed, rate_limit=5)
    later = time.time() + 3600
    with admin(keyed) as api:
        changed = api.patch(f"/keys/{created['id']}",
                            json={"expires_at": later, "token_quota": 99, "rate_limit": None})
        again = api.get(f"/keys/{created['id']}").json()
    assert changed.status_code == 200, changed.text
    assert again["expires_at"] == pytest.approx(later) and again["token_quota"] == 99
    assert again["rate_limit"] is None
    assert ask(keyed, created["key"])


def test_environment_keys_still_work_and_are_read_only(keyed: RunningProxy) -> None:
    assert ask(keyed, "env-key-alice-01")
    with admin(keyed) as api:
        env_id = next(k["id"] for k in api.get("/keys").json()["data"] if k["user"] == "alice")
        assert api.get(f"/keys/{env_id}").json()["source"] == "env"
        patched = api.patch(f"/keys/{env_id}", json={"token_quota": 1})
        deleted = api.delete(f"/keys/{env_id}")
    for response in (patched, deleted):
        assert "MEMPROXY_API_KEYS" in assert_error(response, 409, "key_id")["message"]
    assert ask(keyed, "env-key-alice-01")


def test_a_key_is_its_own_rate_limit(keyed: RunningProxy) -> None:
    created = make_key(keyed, rate_limit=1)
    assert ask(keyed, created["key"])
    with pytest.raises(openai.RateLimitError, match="1 requests per minute"):
        ask(keyed, created["key"])
    assert ask(keyed, "env-key-alice-01")  # another key, another bucket


def test_an_expired_key_is_refused(keyed: RunningProxy) -> None:
    created = make_key(keyed, expires_at=time.time() + 1.5)
    assert ask(keyed, created["key"])
    time.sleep(1.6)
    with pytest.raises(openai.AuthenticationError, match="expired"):
        ask(keyed, created["key"])
    with admin(keyed) as api:
        assert api.get(f"/keys/{created['id']}").json()["status"] == "expired"


def test_last_use_is_recorded_without_a_write_per_request(keyed: RunningProxy) -> None:
    created = make_key(keyed)
    assert ask(keyed, created["key"])
    deadline = time.monotonic() + 5
    first = None
    with admin(keyed) as api:
        while first is None and time.monotonic() < deadline:
            first = api.get(f"/keys/{created['id']}").json()["last_used_at"]
            time.sleep(0.2)
        assert first is not None and abs(first - time.time()) < 10
        for _ in range(3):
            assert ask(keyed, created["key"])
        time.sleep(1.5)  # past the batched write's delay: nothing new was written
        assert api.get(f"/keys/{created['id']}").json()["last_used_at"] == first


def test_stored_keys_make_an_organisations_members(keyed: RunningProxy) -> None:
    make_key(keyed, user="carol", org="acme")
    with httpx.Client(base_url=f"{keyed.url}/v1/memory", timeout=30,
                      headers={"Authorization": "Bearer env-key-acme-001"}) as org_key:
        member = org_key.get("/facts", headers={"X-Memory-User-Id": "carol"})
        outsider = org_key.get("/facts", headers={"X-Memory-User-Id": "dave"})
    assert member.status_code == 200, member.text
    assert_error(outsider, 403, "X-Memory-User-Id")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/models", None),
    ("/v1/memory/facts", None),
])
def test_auth_keys_refuses_keyless_requests_and_takes_stored_keys(
    strict: RunningProxy, path: str, body: dict[str, Any] | None,
) -> None:
    secret = make_key(strict)["key"]
    with httpx.Client(base_url=strict.url, timeout=30) as http:
        def send(**headers: str) -> httpx.Response:
            if body is None:
                return http.get(path, headers=headers)
            return http.post(path, json=body, headers=headers)

        assert send().status_code == 401
        assert send(Authorization="Bearer sk-not-memproxy-1234").status_code == 401
        assert send(Authorization=f"Bearer {secret}").status_code == 200


def test_auth_keys_refuses_keyless_mcp(strict: RunningProxy) -> None:
    secret = make_key(strict)["key"]
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2025-06-18"}
    with httpx.Client(base_url=strict.url, timeout=30) as http:
        keyless = http.post("/mcp", json=call, headers=headers)
        keyed = http.post("/mcp", json=call, headers={**headers, "Authorization": f"Bearer {secret}"})
    assert keyless.status_code == 401
    assert keyed.status_code == 200, keyed.text


def test_without_auth_keys_a_stored_key_is_taken_and_keyless_requests_go_as_before(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
) -> None:
    proxy = start_proxy(memory=True, admin_key=ADMIN, **QUIET)
    created = make_key(proxy)
    assert ask(proxy, "sk-client-own-key-1")  # bring-your-own-key, as without stored keys
    assert upstream.history[-1].headers["authorization"] == "Bearer sk-client-own-key-1"
    assert ask(proxy, created["key"])
    assert "authorization" not in upstream.history[-1].headers  # the mp- key stays here
    assert ("bob",) in db_rows(proxy, "SELECT DISTINCT user_id FROM turns")
    with admin(proxy) as api:
        api.delete(f"/keys/{created['id']}")
    with pytest.raises(openai.AuthenticationError):
        ask(proxy, created["key"])  # a memproxy key is checked, never passed on


def test_the_keys_commands(capsys: pytest.CaptureFixture[str], keyed: RunningProxy) -> None:
    def run(*argv: str) -> tuple[int, str, str]:
        status = main(["keys", *argv, "--url", keyed.url, "--key", ADMIN])
        out, err = capsys.readouterr()
        return status, out, err

    status, out, _ = run("create", "--user", "erin", "--rate-limit", "60",
                         "--expires-at", "2999-01-01T00:00:00")
    secret = out.splitlines()[0]
    assert status == 0 and secret.startswith("mp-") and "only time" in out
    assert ask(keyed, secret)
    status, out, _ = run("list", "--json")
    made = next(k for k in json.loads(out) if k["user"] == "erin")
    assert made["rate_limit"] == 60 and made["expires_at"] == 32472144000.0
    assert secret not in out
    status, out, _ = run("list")
    assert status == 0 and made["id"] in out and "user erin" in out and secret not in out
    status, out, _ = run("show", made["id"], "--json")
    assert json.loads(out)["status"] == "active"
    assert run("revoke", made["id"])[0] == 0
    status, _, err = run("revoke", made["id"])
    assert status == 1 and "already revoked" in err and "409" in err
    assert run("create", "--user", "erin", "--expires-at", "next week")[0] == 2
    status, _, err = main_with_key(capsys, keyed, "env-key-alice-01", "list")
    assert status == 1 and "403" in err


def main_with_key(
    capsys: pytest.CaptureFixture[str], proxy: RunningProxy, key: str, *argv: str
) -> tuple[int, str, str]:
    status = main(["keys", *argv, "--url", proxy.url, "--key", key])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_document_describes_every_admin_route() -> None:
    # The keys' paths; /usage answers every method itself (tests/security/test_admin_usage.py).
    key_paths = {path: item for path, item in DOCUMENT["paths"].items()
                 if path.startswith("/keys")}
    described = {(path, method) for path, item in key_paths.items() for method in item
                 if method not in ("servers", "parameters")}
    served = {(route.path, method.lower()) for route in admin_routes()
              if isinstance(route, Route) and route.path.startswith("/keys")
              for method in route.methods or () if method != "HEAD"}
    assert described == served
    assert all(item["servers"] == [{"url": "/v1/admin"}] for item in key_paths.values())


def test_a_stored_key_s_tokens_show_in_the_usage_its_quota_holds_and_it_is_revoked(
    keyed: RunningProxy, upstream: ScriptedUpstream,
) -> None:
    """The whole walk of a team's key: made with a quota, used, seen in the usage under its
    id, refused once the quota is spent (429), refused once revoked (401)."""
    created = make_key(keyed, token_quota=100)
    upstream.enqueue(JSONReply(chat_completion("big", usage={
        "prompt_tokens": 80, "completion_tokens": 30, "total_tokens": 110})))
    assert ask(keyed, created["key"]) == "big"
    deadline = time.monotonic() + 10  # counts are flushed every MEMPROXY_USAGE_FLUSH_SECONDS
    while True:
        with admin(keyed) as api:
            rows = api.get("/usage", params={"key_id": created["id"]}).json()["data"]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["user_id"], r["requests"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        ("bob", 1, 80, 30)]
    sent = len(upstream.history)
    with pytest.raises(openai.RateLimitError, match="monthly token quota is spent"):
        ask(keyed, created["key"])
    assert len(upstream.history) == sent
    with admin(keyed) as api:
        assert api.delete(f"/keys/{created['id']}").status_code == 200
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        ask(keyed, created["key"])
