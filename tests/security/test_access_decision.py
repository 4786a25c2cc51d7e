"""The one access decision (proxy/access/decision.py): a test per actor of its table, through real
HTTP requests to the app, on every way memory is read or changed.

Each actor tries the victim's memory through a dry run, a chat that recalls (whole and
streamed, in tool mode), Responses, Messages, and the memory API (read, export, turns,
pinned facts, clear). What the memory API refuses, no chat reads: not in a dry run's block,
nor in the prompt the upstream receives. A remote address needs a second machine, so the
app is driven in-process through httpx's ASGI transport with the client's address set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from config import Settings
from memory.index.embeddings import LocalEmbedder
from proxy.app import create_app
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET, assert_error
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import query

SECRET = "The locker code of the victim is 4417."
# What shows the secret got through: the code alone can turn up in a random hex id.
LEAK = "victim is 4417"
QUESTION = "What is the locker code?"
LOOPBACK, REMOTE = "127.0.0.1", "203.0.113.9"
ADMIN = "key-admin-000001"
KEYS = ",".join([
    "key-alice-000001:alice:org=acme",  # alice is a member of acme
    "key-acme-writer1:org=acme:org-writer",  # acme's key for its members, no user of its own
    "key-acme-reader1:org=acme",
    "key-carol-000001:carol:org=globex",
    "key-dave-0000001:dave",  # in no organisation
    "key-plain-000001",  # bound to nobody: a multi-user application's key
])


@asynccontextmanager
async def running(settings: Settings, embedder: LocalEmbedder) -> AsyncIterator[Starlette]:
    app = create_app(settings, with_memory=True, embedder=embedder)
    async with app.router.lifespan_context(app):
        yield app


def client(app: Starlette, host: str = LOOPBACK, key: str | None = None, **headers: str
           ) -> httpx.AsyncClient:
    """A client of `app` connecting from `host`, presenting `key`."""
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    transport = httpx.ASGITransport(app=app, client=(host, 50000))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080",
                             headers=headers, timeout=60)


async def plant(app: Starlette, settings: Settings, user: str, **auth: str) -> None:
    """A pinned fact in `user`'s memory, written through the memory API."""
    async with client(app, **auth) as http:
        added = await http.post("/v1/memory/facts", headers={"X-Memory-User-Id": user},
                                json={"text": SECRET, "category": "context", "pinned": True})
        assert added.status_code == 201, added.text
    await settled(settings)


async def settled(settings: Settings) -> None:
    """The app's jobs are done (waited for off the event loop the app runs on)."""
    await asyncio.to_thread(wait_for_jobs, settings)


# Every format, whole and streamed, and tool mode: (path, body, extra headers).
def requests(upstream: ScriptedUpstream) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": QUESTION}]}
    return [
        ("/v1/chat/completions", chat, {}),
        ("/v1/chat/completions", {**chat, "stream": True}, {}),
        ("/v1/chat/completions", chat, {"X-Memory-Mode": "tool"}),
        ("/v1/responses", {"model": "gpt-4o", "input": QUESTION}, {}),
        ("/v1/responses", {"model": "gpt-4o", "input": QUESTION, "stream": True}, {}),
        ("/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 64,
                          "messages": [{"role": "user", "content": QUESTION}]}, {}),
    ]


async def assert_no_memory_reaches(
    http: httpx.AsyncClient, upstream: ScriptedUpstream, victim: str, why: str,
    **body_user: str,
) -> None:
    """Every format's chat goes through, with no memory of `victim` and X-Memory-Error:
    `why`; every format's dry run is refused as the memory API refuses it. The victim is
    named by the header, or by the body (`body_user`)."""
    headers = {"X-Memory-User-Id": victim} if not body_user else {}
    for path, body, extra in requests(upstream):
        sent = len(upstream.history)
        reply = await http.post(path, json={**body, **body_user}, headers={**headers, **extra})
        assert reply.status_code == 200, (path, reply.text)
        assert reply.headers["x-memory-error"] == f"access: {why}", (path, extra)
        assert LEAK not in reply.text
        assert len(upstream.history) > sent and all(
            LEAK not in r.body.decode() for r in upstream.history[sent:]), (path, extra)
        dry = await http.post(path, json={**body, **body_user},
                              headers={**headers, **extra, "X-Memory-Dry-Run": "on"})
        assert dry.status_code == (401 if why == "AuthenticationFailed" else 403), (path, dry.text)
        assert LEAK not in dry.text


async def assert_memory_reaches(http: httpx.AsyncClient, user: str) -> None:
    for path, body in (
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": QUESTION}]}),
        ("/v1/responses", {"model": "gpt-4o", "input": QUESTION}),
    ):
        dry = await http.post(path, json=body, headers={"X-Memory-User-Id": user,
                                                          "X-Memory-Dry-Run": "on"})
        assert dry.status_code == 200 and LEAK in dry.json()["block"], dry.text


def stored_users(settings: Settings) -> set[str]:
    return {row[0] for row in query(settings, "SELECT DISTINCT user_id FROM turns")}


# -- no keys configured ---------------------------------------------------------------------


async def test_no_keys_a_remote_client_reaches_no_memory_through_any_route(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder, upstream: ScriptedUpstream
) -> None:
    settings = make_settings(memory=True, anthropic_base_url=upstream.base_url.removesuffix("/v1"),
                             **QUIET)
    async with running(settings, embedder) as app:
        await plant(app, settings, "victim")
        async with client(app, REMOTE) as remote:
            assert_error(await remote.get("/v1/memory/facts",
                                          headers={"X-Memory-User-Id": "victim"}), 403)
            await assert_no_memory_reaches(remote, upstream, "victim", "PermissionDenied")
            # The body's user names the victim just as well.
            await assert_no_memory_reaches(remote, upstream, "victim", "PermissionDenied",
                                           user="victim")
        await settled(settings)
        assert stored_users(settings) == set()  # a refused chat remembers nothing either
        async with client(app, LOOPBACK) as local:  # local single-user mode is unchanged
            await assert_memory_reaches(local, "victim")


async def test_no_keys_management_remote_opens_memory_to_remote_chats_too(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> None:
    settings = make_settings(memory=True, management_remote=True, **QUIET)
    async with running(settings, embedder) as app:
        await plant(app, settings, "victim")
        async with client(app, REMOTE) as remote:
            assert (await remote.get("/v1/memory/facts", headers={
                "X-Memory-User-Id": "victim"})).status_code == 200
            await assert_memory_reaches(remote, "victim")


async def test_only_the_admin_key_set_no_other_request_reaches_memory(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder, upstream: ScriptedUpstream
) -> None:
    settings = make_settings(memory=True, admin_key=ADMIN,
                             anthropic_base_url=upstream.base_url.removesuffix("/v1"), **QUIET)
    async with running(settings, embedder) as app:
        await plant(app, settings, "victim", key=ADMIN)
        for host in (LOOPBACK, REMOTE):
            for key in (None, "sk-some-client-key"):
                async with client(app, host, key) as http:
                    assert_error(await http.get("/v1/memory/facts"), 401)
                    await assert_no_memory_reaches(http, upstream, "victim", "AuthenticationFailed")
        async with client(app, REMOTE, ADMIN) as admin:
            facts = (await admin.get("/v1/memory/facts", headers={"X-Memory-User-Id": "victim"}))
            assert [f["text"] for f in facts.json()["data"]] == [SECRET]


# -- proxy keys -----------------------------------------------------------------------------


@pytest.fixture
def keyed(make_settings: Callable[..., Settings], upstream: ScriptedUpstream) -> Settings:
    return make_settings(memory=True, api_keys=KEYS, admin_key=ADMIN,
                         anthropic_base_url=upstream.base_url.removesuffix("/v1"), **QUIET)


async def test_a_key_bound_to_a_user_reaches_that_user_only(
    keyed: Settings, embedder: LocalEmbedder, upstream: ScriptedUpstream
) -> None:
    async with running(keyed, embedder) as app:
        await plant(app, keyed, "alice", key=ADMIN)
        await plant(app, keyed, "victim", key=ADMIN)
        async with client(app, REMOTE, "key-alice-000001") as alice:
            await assert_memory_reaches(alice, "alice")
            for path in ("/v1/memory/facts", "/v1/memory/export", "/v1/memory/turns?session_id=s"):
                assert_error(await alice.get(path, headers={"X-Memory-User-Id": "victim"}),
                             403, "X-Memory-User-Id")
            dry = await alice.post("/v1/chat/completions", headers={
                "X-Memory-User-Id": "victim", "X-Memory-Dry-Run": "on"}, json={
                "model": "gpt-4o", "messages": [{"role": "user", "content": QUESTION}]})
            assert_error(dry, 403, "X-Memory-User-Id")
            # A body user never moves a bound key: the recall is alice's own.
            own = await alice.post("/v1/chat/completions", headers={"X-Memory-Dry-Run": "on"},
                                   json={"model": "gpt-4o", "user": "victim",
                                         "messages": [{"role": "user", "content": QUESTION}]})
            assert own.json()["user_id"] == "alice"


async def test_an_unbound_key_and_the_admin_key_reach_any_user(
    keyed: Settings, embedder: LocalEmbedder
) -> None:
    async with running(keyed, embedder) as app:
        await plant(app, keyed, "victim", key=ADMIN)
        async with client(app, REMOTE, "key-plain-000001") as plain:
            await assert_memory_reaches(plain, "victim")
        async with client(app, REMOTE, ADMIN) as admin:
            exported = await admin.get("/v1/memory/export", headers={"X-Memory-User-Id": "victim"})
            assert exported.status_code == 200 and LEAK in exported.text
            # The admin key is the memory API's: a chat does not take it.
            reply = await admin.post("/v1/chat/completions", json={
                "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
            assert_error(reply, 401)


@pytest.mark.both_backends
async def test_an_org_key_reaches_its_members_and_no_one_else(
    keyed: Settings, embedder: LocalEmbedder, upstream: ScriptedUpstream
) -> None:
    async with running(keyed, embedder) as app:
        for user in ("alice", "carol", "dave", "stranger", "default"):
            await plant(app, keyed, user, key=ADMIN)
        for key in ("key-acme-writer1", "key-acme-reader1"):
            async with client(app, REMOTE, key) as org:
                await assert_memory_reaches(org, "alice")  # a member of acme
                for outsider in ("carol", "dave", "stranger"):  # globex's, no org's, nobody's
                    named = {"X-Memory-User-Id": outsider}
                    for path in ("/v1/memory/facts", "/v1/memory/export", "/v1/memory/stats",
                                 "/v1/memory/sessions", "/v1/memory/turns?session_id=s"):
                        assert_error(await org.get(path, headers=named), 403, "X-Memory-User-Id")
                    for path, body in (("/v1/memory/facts", {"text": "Pwned.", "category": "context",
                                                             "pinned": True}),
                                       ("/v1/memory/clear", {}),
                                       ("/v1/memory/search", {"query": QUESTION})):
                        assert_error(await org.post(path, headers=named, json=body), 403,
                                     "X-Memory-User-Id")
                    await assert_no_memory_reaches(org, upstream, outsider, "PermissionDenied")
                # No user named: `default`, who is no member either.
                assert_error(await org.get("/v1/memory/facts"), 403, "X-Memory-User-Id")
        await settled(keyed)
        assert stored_users(keyed) == set()
        async with client(app, REMOTE, ADMIN) as admin:  # the outsiders' memory is as it was
            for outsider in ("carol", "dave", "stranger"):
                facts = await admin.get("/v1/memory/facts", headers={"X-Memory-User-Id": outsider})
                assert [f["text"] for f in facts.json()["data"]] == [SECRET]


async def test_org_shared_memory_read_by_members_written_by_writers(
    keyed: Settings, embedder: LocalEmbedder
) -> None:
    fact = {"text": "Deploys freeze on Fridays.", "category": "decision"}
    async with running(keyed, embedder) as app:
        async with client(app, REMOTE, "key-acme-writer1", **{"X-Memory-Org-Id": "acme"}) as w:
            assert (await w.post("/v1/memory/facts", json=fact)).status_code == 201
        for key in ("key-acme-reader1", "key-alice-000001"):
            async with client(app, REMOTE, key, **{"X-Memory-Org-Id": "acme"}) as member:
                assert len((await member.get("/v1/memory/facts")).json()["data"]) == 1
                assert_error(await member.post("/v1/memory/facts", json=fact), 403,
                             "X-Memory-Org-Id")
        for key in ("key-carol-000001", "key-dave-0000001"):
            async with client(app, REMOTE, key, **{"X-Memory-Org-Id": "acme"}) as other:
                assert_error(await other.get("/v1/memory/facts"), 403, "X-Memory-Org-Id")
        async with client(app, REMOTE, "key-plain-000001", **{"X-Memory-Org-Id": "acme"}) as plain:
            assert (await plain.get("/v1/memory/facts")).status_code == 200
            assert_error(await plain.post("/v1/memory/facts", json=fact), 403, "X-Memory-Org-Id")
