"""The admin API's keys under attack (docs/security.md, "Keys in the database"): only the
admin key manages keys; bad input changes nothing; a revoked or expired key is refused on
another replica within 5 s; the secret is nowhere but in the creator's answer (not in the
database files or a dump, the logs, /metrics or a memory export); a stored key reaches only
its own user's memory. Real HTTP against real servers, both backends where storage is."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case
from schemathesis.specs.openapi.checks import positive_data_acceptance

from proxy.management.openapi import DOCUMENT
from tests.conftest import RunningProxy
from tests.support.memory import QUIET, assert_error, db_rows, export_records
from tests.support.servers import PostgresServer, postgres_bin
from tests.test_admin_keys import ADMIN, admin, ask, make_key

ENV_KEYS = "env-key-alice-01:alice"


@pytest.fixture
def keyed(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True, admin_key=ADMIN, api_keys=ENV_KEYS,
                       upstream_api_key="sk-upstream-0001", **QUIET)


def listed(proxy: RunningProxy) -> list[dict[str, Any]]:
    with admin(proxy) as api:
        data: list[dict[str, Any]] = api.get("/keys").json()["data"]
    return data


@pytest.mark.both_backends
@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/keys", None), ("POST", "/keys", {"user": "mallory"}),
    ("GET", "/keys/{id}", None), ("PATCH", "/keys/{id}", {"token_quota": 1}),
    ("DELETE", "/keys/{id}", None),
])
def test_only_the_admin_key_manages_keys(
    keyed: RunningProxy, method: str, path: str, body: dict[str, Any] | None,
) -> None:
    victim = make_key(keyed)
    stored_user_key = make_key(keyed, user="mallory")["key"]
    url = path.format(id=victim["id"])
    before = listed(keyed)
    callers: list[tuple[dict[str, str], int]] = [
        ({}, 401),
        ({"Authorization": "Bearer not-a-key-at-all"}, 401),
        ({"Authorization": f"Bearer {victim['key'][:-1]}x"}, 401),  # one character off
        ({"Authorization": "Bearer env-key-alice-01"}, 403),  # a user's key from the env
        ({"Authorization": f"Bearer {stored_user_key}"}, 403),  # a stored user key
        ({"x-api-key": "env-key-alice-01"}, 403),
    ]
    with httpx.Client(base_url=f"{keyed.url}/v1/admin", timeout=30) as http:
        for headers, status in callers:
            response = http.request(method, url, json=body, headers=headers)
            assert_error(response, status)
    assert listed(keyed) == before  # nothing was made, changed or revoked


def test_without_an_admin_key_nobody_manages_keys(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(memory=True, api_keys=ENV_KEYS, **QUIET)
    with httpx.Client(base_url=f"{proxy.url}/v1/admin", timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer env-key-alice-01"}):
            error = assert_error(http.post("/keys", json={"user": "x"}, headers=headers), 403)
            assert "MEMPROXY_ADMIN_KEY" in error["message"]


def test_a_web_page_cannot_make_a_key(keyed: RunningProxy) -> None:
    with httpx.Client(base_url=f"{keyed.url}/v1/admin", timeout=30) as http:
        for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            response = http.post("/keys", json={"user": "x"}, headers={
                "Authorization": f"Bearer {ADMIN}", **headers})
            assert response.status_code == 403
        form = http.post("/keys", content=b'{"user": "x"}', headers={
            "Authorization": f"Bearer {ADMIN}", "Content-Type": "text/plain"})
        assert form.status_code == 415
    assert [k for k in listed(keyed) if k["source"] == "database"] == []


BAD_CREATES: list[tuple[Any, str | None, str]] = [
    ({"user": "bob", "colour": "red"}, "colour", "unknown field"),
    ({"user": "bob", "token_quota": -1}, "token_quota", "between"),
    ({"user": "bob", "rate_limit": -5}, "rate_limit", "between"),
    ({"user": "bob", "rate_limit": 0}, "rate_limit", "between"),
    ({"user": "bob", "rate_limit": 2.5}, "rate_limit", "integer"),
    ({"user": "x" * 257}, "user", "256"),
    ({"user": " bob"}, "user", "spaces"),
    ({"user": "bob\n"}, "user", "printable"),
    ({"user": 7}, "user", "printable"),
    ({"user": "bob", "org": "o" * 257}, "org", "256"),
    ({"user": "bob", "expires_at": 1_000_000}, "expires_at", "past"),
    ({"user": "bob", "expires_at": "tomorrow"}, "expires_at", "number"),
    ({"user": "bob", "org_writer": True}, "org_writer", "organisation"),
    ({"user": "bob", "org_writer": "yes"}, "org_writer", "true or false"),
    ({}, "user", "required"),
    (["bob"], None, "JSON object"),
    ("not json", None, "valid JSON"),
]


@pytest.mark.both_backends
def test_bad_input_is_refused_and_changes_nothing(keyed: RunningProxy) -> None:
    kept = make_key(keyed, rate_limit=5, token_quota=100)
    before = listed(keyed)
    with admin(keyed) as api:
        for body, param, words in BAD_CREATES:
            content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            response = api.post("/keys", content=content,
                                headers={"Content-Type": "application/json"})
            error = assert_error(response, 400, param)
            assert words in error["message"], (body, error)
        one = f"/keys/{kept['id']}"
        for body, param in [({"colour": 1}, "colour"), ({"token_quota": -1}, "token_quota"),
                            ({"rate_limit": -1}, "rate_limit"), ({"user": "eve"}, "user"),
                            ({"expires_at": 5}, "expires_at"), ({}, None),
                            ({"org_writer": True}, "org_writer")]:
            assert_error(api.patch(one, json=body), 400, param)
        for method in ("GET", "PATCH", "DELETE"):
            missing = api.request(method, "/keys/key_0000000000000000",
                                  json={"token_quota": 1} if method == "PATCH" else None)
            assert assert_error(missing, 404, "key_id")["code"] == "key_not_found"
    assert listed(keyed) == before
    assert ask(keyed, kept["key"])


@pytest.mark.both_backends
def test_revoking_twice_is_a_conflict_and_a_revoked_key_cannot_change(keyed: RunningProxy) -> None:
    created = make_key(keyed)
    with admin(keyed) as api:
        first = api.delete(f"/keys/{created['id']}")
        again = api.delete(f"/keys/{created['id']}")
        patched = api.patch(f"/keys/{created['id']}", json={"token_quota": 5})
    assert first.status_code == 200
    assert assert_error(again, 409, "key_id")["code"] == "key_revoked"
    assert assert_error(patched, 409, "key_id")["code"] == "key_revoked"
    assert first.json()["revoked_at"] == listed(keyed)[-1]["revoked_at"]


@pytest.mark.both_backends
def test_a_stored_key_reaches_its_own_user_only(keyed: RunningProxy) -> None:
    created = make_key(keyed, user="bob")
    secret = created["key"]
    with httpx.Client(base_url=f"{keyed.url}/v1/memory", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"}) as bob:
        assert bob.get("/facts").status_code == 200
        assert_error(bob.get("/facts", headers={"X-Memory-User-Id": "alice"}), 403)
        assert_error(bob.get("/facts", headers={"X-Memory-Org-Id": "acme"}), 403)
    # Its digest is in the database; as a key it is nothing.
    ((digest,),) = db_rows(keyed, "SELECT digest FROM api_keys WHERE id = ?", (created["id"],))
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        for fake in (digest, "mp-00000000_" + "A" * 43, "mp-", "mp-" + "x" * 5000):
            assert http.get("/v1/memory/facts",
                            headers={"Authorization": f"Bearer {fake}"}).status_code == 401


@pytest.mark.both_backends
def test_the_secret_is_nowhere_but_in_the_answer_that_made_it(
    keyed: RunningProxy, caplog: pytest.LogCaptureFixture, backend: str, tmp_path: Path,
) -> None:
    memproxy_log = logging.getLogger("memproxy")
    memproxy_log.addHandler(caplog.handler)
    memproxy_log.setLevel(logging.DEBUG)
    try:
        created = make_key(keyed, user="bob")
        secret = created["key"]
        for text in ("remember my dog Rex", "and my cat Tom"):
            assert ask(keyed, secret, text)
        with admin(keyed) as api:
            api.patch(f"/keys/{created['id']}", json={"token_quota": 10})
            api.delete(f"/keys/{created['id']}")
        with pytest.raises(openai.AuthenticationError):
            ask(keyed, secret)
        exported = export_records(keyed, Authorization=f"Bearer {ADMIN}",
                                  **{"X-Memory-User-Id": "bob"})
        metrics = httpx.get(f"{keyed.url}/metrics", timeout=30).text
    finally:
        memproxy_log.removeHandler(caplog.handler)
    keyed.stop()  # everything written and closed: the files hold all they will

    secret_part = secret.split("_", 1)[1]
    assert any(r["type"] == "turn" and "Rex" in r["content"] for r in exported)
    places = {
        "logs": "\n".join(r.getMessage() + json.dumps(r.__dict__, default=str)
                          for r in caplog.records),
        "metrics": metrics, "export": json.dumps(exported),
        "database": _database_bytes(keyed, backend, tmp_path).decode("latin-1"),
    }
    assert created["id"] in places["database"]  # the row is there, by id
    for name, text in places.items():
        assert secret_part not in text, name


def _database_bytes(proxy: RunningProxy, backend: str, tmp_path: Path) -> bytes:
    """Every byte of the SQLite files, or a pg_dump of the PostgreSQL database."""
    settings = proxy.state.settings
    if backend == "sqlite":
        files = sorted(settings.data_dir.glob("*.db*")) + sorted(settings.data_dir.glob("*.sqlite3*"))
        assert files
        return b"".join(path.read_bytes() for path in files)
    out = tmp_path / "dump.sql"
    subprocess.run([str(postgres_bin() / "pg_dump"), "-f", str(out), settings.database_url],
                   check=True, capture_output=True)
    return out.read_bytes()


@pytest.fixture
def two_replicas(
    start_proxy: Callable[..., RunningProxy], postgres_server: PostgresServer, tmp_path: Path,
) -> Iterator[tuple[RunningProxy, RunningProxy]]:
    """Two memproxy apps on one PostgreSQL database, each with its own data directory."""
    url = postgres_server.create_database()
    first, second = (
        start_proxy(memory=True, admin_key=ADMIN, auth="keys", database_url=url,
                    data_dir=str(tmp_path / name), upstream_api_key="sk-upstream-0001", **QUIET)
        for name in ("a", "b")
    )
    yield first, second


def _refused_within(proxy: RunningProxy, secret: str, seconds: float) -> float:
    """Seconds until `proxy` refuses `secret` (401), asked every 50 ms; fails past `seconds`."""
    started = time.monotonic()
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        while time.monotonic() - started < seconds:
            status = http.get("/v1/memory/facts",
                              headers={"Authorization": f"Bearer {secret}"}).status_code
            if status == 401:
                return time.monotonic() - started
            assert status == 200
            time.sleep(0.05)
    raise AssertionError(f"still accepted {seconds} s later")


def test_a_revoked_key_is_refused_on_another_replica_within_5_seconds(
    two_replicas: tuple[RunningProxy, RunningProxy],
) -> None:
    first, second = two_replicas
    created = make_key(first)
    assert ask(second, created["key"])  # the other replica knows (and caches) the key
    with admin(first) as api:
        assert api.delete(f"/keys/{created['id']}").status_code == 200
    took = _refused_within(second, created["key"], 5.0)
    print(f"revocation seen by the other replica after {took:.2f} s")
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        ask(second, created["key"])


def test_an_expired_key_is_refused_on_another_replica_within_5_seconds(
    two_replicas: tuple[RunningProxy, RunningProxy],
) -> None:
    first, second = two_replicas
    expires = time.time() + 1.0
    created = make_key(first, expires_at=expires)
    assert ask(second, created["key"])
    time.sleep(max(0.0, expires - time.time()))
    took = _refused_within(second, created["key"], 5.0)
    print(f"expiry seen by the other replica {took:.2f} s after expires_at")
    # A PATCH that sets a new expiry in the past is refused; a later one brings it back.
    with admin(first) as api:
        assert api.patch(f"/keys/{created['id']}",
                         json={"expires_at": time.time() + 60}).status_code == 200
    assert _accepted_within(second, created["key"], 5.0)


def _accepted_within(proxy: RunningProxy, secret: str, seconds: float) -> bool:
    started = time.monotonic()
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        while time.monotonic() - started < seconds:
            if http.get("/v1/memory/facts",
                        headers={"Authorization": f"Bearer {secret}"}).status_code == 200:
                return True
            time.sleep(0.05)
    return False


# The admin API's own operations, fuzzed with the admin key. positive_data_acceptance is
# off: "a future time" and "printable" are checks a JSON schema cannot state.
admin_schema = schemathesis.openapi.from_dict(DOCUMENT).include(tag="admin")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, embedder: Any) -> Iterator[RunningProxy]:
    from config import load_settings
    from tests.conftest import MODEL_DIR, serve
    from tests.support.scripted_upstream import ScriptedUpstream

    data = tmp_path_factory.mktemp("fuzz-admin")
    with ScriptedUpstream(keep_history=False) as upstream:
        running = serve(load_settings(env={
            "MEMPROXY_UPSTREAM_BASE_URL": upstream.base_url, "MEMPROXY_DATA_DIR": str(data),
            "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR), "MEMPROXY_LOG_LEVEL": "error",
            "MEMPROXY_ADMIN_KEY": ADMIN, "MEMPROXY_API_KEYS": ENV_KEYS,
            "MEMPROXY_EXTRACT_EVERY": "0", "MEMPROXY_SUMMARY_EVERY": "0",
        }), with_memory=True, embedder=embedder)
        try:
            yield running
        finally:
            running.stop()


@pytest.mark.fuzz
@admin_schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_the_admin_api_conforms_to_its_document(
    case: Case[Any], fuzzed: RunningProxy, case_counts: Counter[str],
) -> None:
    case_counts[f"schemathesis: {case.operation.label}"] += 1
    case.call_and_validate(base_url=f"{fuzzed.url}/v1/admin", timeout=30,
                           headers={"Authorization": f"Bearer {ADMIN}"},
                           excluded_checks=[positive_data_acceptance])
