"""Isolation: many users with hostile ids, each with a secret, through the real proxy.

Recall (what the upstream receives, and dry runs), search, export, the panel's endpoints and
every delete must reach the caller's memory only. The lexical (SQL/FTS5) path and the dense
(Chroma filter) path run separately: a search weight of 0 skips that search entirely.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config import ApiKey
from memory.storage.fts import CHUNK_COLUMNS, match_expression, search_terms
from memory.storage.postgres import PostgresDatabase
from proxy.access.identity import resolve_user
from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET, assert_error
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import query as sql_query

pytestmark = pytest.mark.both_backends

QUERY = "What is my favourite island, and what is my lucky charm?"
MARK = re.compile(r"(?:isle|charm)zq\d{4}x")
# Ids that look like SQL, paths, globs and LIKE patterns, FTS5 syntax, and unicode.
ODD_IDS = [
    "'; DROP TABLE turns;--", '" OR 1=1', "' OR '1'='1", "../../etc", "a/b", "*", "?",
    "[a-z]", "%", "_", "a%b", "NEAR", '"', "-", "OR", "NEAR(a b)", "owner:u1", "{text}:x",
    "\u05e9\u05dc\u05d5\u05dd", "\U0001f600", "Zo\u00eb", "Alice", "alice",
    "default",
]
NASTY = "'\"%_*?[]-/\\.:;(){}^$ |<>&#=!~`,+@aZ9\u00e9\u05d0\u0645\u4e2d\U0001f525\u202e\u200d"
# Body ids (OpenAI's `user` field) take what a header cannot carry.
BODY_IDS = ["\u202eevil\u202c", "ctl\x01id\x1fx", "tab\tid", "L" * 256 + "1", "L" * 256 + "2"]
# Header ids must be 1-256 printable characters once trimmed (sent as UTF-8): empty, only
# (unicode) spaces, too long, a tab, a line separator, NEL, a bidi override are refused.
REJECTED_HEADER_IDS = [
    b"", "\u00a0\u3000".encode(), b"a" * 257, b"tab\there", "\u2028".encode(),
    "x\u0085y".encode(), "\u202eevil".encode(),
]


@dataclass
class User:
    uid: str
    index: int
    via_body: bool = False
    fact_id: int = 0

    @property
    def island(self) -> str:
        return f"islezq{self.index:04d}x"

    @property
    def charm(self) -> str:
        return f"charmzq{self.index:04d}x"

    @property
    def resolved(self) -> str:
        """The id memproxy stores (over-long body ids are shortened)."""
        return resolve_user({}, {"user": self.uid}, None)

    @property
    def headers(self) -> dict[bytes, bytes]:
        return {} if self.via_body else {b"X-Memory-User-Id": self.uid.encode()}


def random_ids(count: int, seed: int) -> list[str]:
    """Random short ids drawn from characters with a meaning somewhere in the stack."""
    rng = random.Random(seed)
    ids: list[str] = []
    while len(ids) < count:
        uid = "".join(rng.choice(NASTY) for _ in range(rng.randint(1, 12))).strip()
        if uid and uid.isprintable() and uid not in ids and uid not in ODD_IDS:
            ids.append(uid)
    return ids


def make_users(seed: int) -> list[User]:
    ids = ODD_IDS + random_ids(30 - len(ODD_IDS), seed)
    users = [User(uid, i) for i, uid in enumerate(ids)]
    users += [User(uid, len(users) + i, via_body=True) for i, uid in enumerate(BODY_IDS)]
    return users


# One keep-alive client per proxy for the many chat calls (closed after each test).
_CHAT: dict[int, httpx.Client] = {}


@pytest.fixture(autouse=True)
def _close_chat_clients() -> Iterator[None]:
    yield
    for http in _CHAT.values():
        http.close()
    _CHAT.clear()


def chat(proxy: RunningProxy, user: User, text: str, session: str, **headers: str) -> httpx.Response:
    http = _CHAT.get(proxy.port) or _CHAT.setdefault(
        proxy.port, httpx.Client(base_url=proxy.base_url, timeout=60)
    )
    body: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": text}]}
    if user.via_body:
        body["user"] = user.uid
    return http.post("/chat/completions", json=body, headers={
        **user.headers, b"X-Memory-Session-Id": session.encode(),
        **{name.encode(): value.encode() for name, value in headers.items()},
    })


def marks(text: str) -> set[str]:
    return set(MARK.findall(text))


def own(user: User) -> set[str]:
    return {user.island, user.charm}


@pytest.fixture
def api(start_proxy: Callable[..., RunningProxy]) -> Iterator[Callable[..., tuple[RunningProxy, httpx.Client]]]:
    clients: list[httpx.Client] = []

    def start(**weights: float) -> tuple[RunningProxy, httpx.Client]:
        proxy = start_proxy(memory=True, **QUIET, **weights)
        client = httpx.Client(base_url=f"{proxy.url}/v1/memory", timeout=60)
        clients.append(client)
        return proxy, client

    yield start
    for client in clients:
        client.close()


def seed(proxy: RunningProxy, api: httpx.Client, users: list[User]) -> None:
    """Each user: a turn in a session every user shares the name of, one in a session named
    like the user, and a fact."""
    for user in users:
        for text, session in ((f"My favourite island is {user.island}.", "shared"),
                              (f"Note to self: the island is {user.island}.",
                               "own" if user.via_body else user.uid)):
            response = chat(proxy, user, text, session)
            assert response.status_code == 200, response.text
            # The session id comes back as the bytes it was sent in.
            assert dict(response.headers.raw)[b"x-memory-session-id"] == session.encode()
        if not user.via_body:
            response = api.post("/facts", headers=user.headers, json={
                "text": f"User's lucky charm is {user.charm}", "category": "identity",
            })
            assert response.status_code == 201, response.text
            user.fact_id = response.json()["id"]
    wait_for_jobs(proxy)


def check_recall(proxy: RunningProxy, upstream: ScriptedUpstream, user: User) -> int:
    """What the upstream receives and what a dry run shows hold this user's secrets only."""
    upstream.clear()
    response = chat(proxy, user, QUERY, "asking", **{"X-Memory-Write": "off"})
    assert response.status_code == 200, response.text
    sent = str(upstream.history[-1].json["messages"])
    assert user.island in marks(sent) <= own(user), (user.uid, sent)
    dry = chat(proxy, user, QUERY, "asking", **{"X-Memory-Dry-Run": "on"}).json()
    assert dry["user_id"] == user.resolved
    assert user.island in marks(dry["block"]) <= own(user), (user.uid, dry["block"])
    # Session scope, in a session every user has one of the same name.
    scoped = chat(proxy, user, QUERY, "shared", **{"X-Memory-Dry-Run": "on",
                                                   "X-Memory-Scope": "session"}).json()
    assert marks(scoped["block"]) == {user.island}, (user.uid, scoped["block"])
    return 3


def check_search(api: httpx.Client, user: User) -> int:
    response = api.post("/search", headers=user.headers, json={"query": QUERY})
    assert response.status_code == 200, response.text
    found = response.json()
    assert found["user_id"] == user.uid
    assert marks(found["block"]) == own(user), (user.uid, found["block"])
    return 1


def check_reads(api: httpx.Client, user: User, users: list[User]) -> int:
    """Export and the panel's endpoints show this user's memory, and nobody else's."""
    h = user.headers
    export = api.get("/export", headers=h)
    assert export.status_code == 200 and marks(export.text) == own(user), user.uid
    assert json.loads(export.text.split("\n", 1)[0])["user_id"] == user.uid
    facts = api.get("/facts", headers=h).json()["data"]
    assert [f["id"] for f in facts] == [user.fact_id]
    sessions = api.get("/sessions", headers=h).json()["data"]
    assert {s["session_id"] for s in sessions} == {"shared", user.uid}
    for session in ("shared", user.uid):
        turns = api.get("/turns", headers=h, params={"session_id": session}).json()["data"]
        assert len(turns) == 2 and marks(str(turns)) == {user.island}, (user.uid, turns)
        found = api.get(f"/sessions/{quote(session, safe='')}", headers=h)
        assert found.status_code == 200 and found.json()["turns"] == 2, found.text
    stats = api.get("/stats", headers=h).json()
    assert stats["user_id"] == user.uid and not marks(str(stats))
    assert (stats["counts"]["turns"], stats["counts"]["facts"]) == (4, 1), (user.uid, stats)
    metrics = api.get("/metrics", headers=h)
    assert metrics.status_code == 200 and not marks(metrics.text) - own(user)
    checks = 8
    other = users[(user.index + 1) % len([u for u in users if not u.via_body])]
    for method, path in (("GET", f"/facts/{other.fact_id}"), ("PATCH", f"/facts/{other.fact_id}"),
                         ("DELETE", f"/facts/{other.fact_id}"),
                         ("POST", f"/facts/{other.fact_id}/pin"),
                         ("GET", f"/facts/{other.fact_id}/history"),
                         ("GET", f"/sessions/{quote(other.uid, safe='')}"),
                         ("DELETE", f"/sessions/{quote(other.uid, safe='')}")):
        body = {"text": "hijacked"} if method == "PATCH" else None
        assert_error(api.request(method, path, headers=h, json=body), 404)
        checks += 1
    assert_error(api.get("/turns", headers=h, params={"session_id": other.uid}), 404)
    return checks + 1


def counts(proxy: RunningProxy, users: list[User]) -> dict[str, tuple[int, ...]]:
    """Rows and vectors each user owns, straight from storage (one query a table: on
    PostgreSQL every query is a connection of its own)."""
    per_table = [
        dict(sql_query(proxy.state.settings,
                       f"SELECT user_id, count(*) FROM {table} GROUP BY user_id"))
        for table in ("turns", "chunks", "sessions", "facts")
    ]
    return {
        user.uid: (*(rows.get(user.resolved, 0) for rows in per_table),
                   proxy.state.memory.vectors.count({"user_id": user.resolved}))
        for user in users
    }


def check_fts_layer(proxy: RunningProxy, users: list[User]) -> int:
    """The SQL/FTS5 scope on its own: recall drops other users' rows once more later, so a
    leak in this layer alone would not show end to end."""
    if proxy.state.settings.database_url:
        return check_postgres_text_layer(proxy, users)
    chunks = ("SELECT c.user_id FROM chunks_fts JOIN chunks AS c ON c.id = chunks_fts.rowid"
              " WHERE chunks_fts MATCH ?")
    facts = ("SELECT f.user_id FROM facts_fts JOIN facts AS f ON f.id = facts_fts.rowid"
             " WHERE facts_fts MATCH ?")
    with closing(sqlite3.connect(proxy.state.settings.db_path)) as conn:
        for user in users:
            owners = conn.execute(chunks, (match_expression(user.resolved, QUERY,
                                                            columns=CHUNK_COLUMNS),)).fetchall()
            assert len(owners) == 4 and {o for (o,) in owners} == {user.resolved}, user.uid
            owners = conn.execute(facts, (match_expression(user.resolved, QUERY),)).fetchall()
            assert owners == ([] if user.via_body else [(user.uid,)]), user.uid
    return 2 * len(users)


def check_postgres_text_layer(proxy: RunningProxy, users: list[User]) -> int:
    """The same on PostgreSQL, through the search functions recall calls."""
    from memory.storage import facts, turns

    async def search_all() -> dict[str, tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]]:
        """The owners of the rows each user's search found (one pool for them all)."""
        db = await PostgresDatabase.open(str(proxy.state.settings.database_url), connections=1)

        async def owners(table: str, hits: list[tuple[int, float]]) -> list[tuple[Any, ...]]:
            rows = await db.fetch(f"SELECT user_id FROM {table} WHERE id = ANY(?)",
                                  ([i for i, _ in hits],))
            return [tuple(row) for row in rows]

        try:
            return {user.uid: (
                await owners("chunks", await turns.search_chunks(
                    db, user.resolved, search_terms(QUERY), k=50)),
                await owners("facts", await facts.search(
                    db, user.resolved, QUERY, k=50, now=time.time())),
            ) for user in users}
        finally:
            await db.close()

    found = asyncio.run(search_all())
    for user in users:
        chunk_owners, fact_owners = found[user.uid]
        assert len(chunk_owners) == 4 and {o for (o,) in chunk_owners} == {user.resolved}, user.uid
        assert fact_owners == ([] if user.via_body else [(user.uid,)]), user.uid
    return 2 * len(users)


def check_vector_layer(proxy: RunningProxy, embedder: Any, users: list[User]) -> int:
    """Chroma's metadata filter on its own: every vector a user's query may reach is theirs."""
    vectors = proxy.state.memory.vectors
    query = asyncio.run(embedder.embed([QUERY]))[0]
    owner = dict(sql_query(proxy.state.settings, "SELECT 'c' || id, user_id FROM chunks UNION ALL"
                                             " SELECT 'f' || id, user_id FROM facts"))
    for user in users:
        hits = vectors.query(query, k=500, where={"user_id": user.resolved})
        assert len(hits) == (4 if user.via_body else 5), (user.uid, hits)
        assert {owner[key] for key, _ in hits} == {user.resolved}, user.uid
    return len(users)


def test_lexical_path_isolates_every_read_and_delete(
    api: Callable[..., tuple[RunningProxy, httpx.Client]], upstream: ScriptedUpstream,
    case_counts: Counter[str],
) -> None:
    proxy, client = api(weight_dense=0.0)
    users = make_users(seed=1)
    header_users = [u for u in users if not u.via_body]
    seed(proxy, client, users)
    cases = check_fts_layer(proxy, users)
    cases += sum(check_recall(proxy, upstream, u) for u in users)
    cases += sum(check_search(client, u) + check_reads(client, u, header_users)
                 for u in header_users)
    before = counts(proxy, users)
    assert all(c[0] == 4 and c[1] >= 4 and c[4] >= 4 for c in before.values()), before
    # Every other user deletes a fact, a session, then everything.
    doomed, survivors = header_users[::2], header_users[1::2]
    tokens = []
    for user in doomed:
        assert client.delete(f"/facts/{user.fact_id}", headers=user.headers).status_code == 200
        assert client.delete("/sessions/shared", headers=user.headers).status_code == 200
        response = client.post("/clear", headers=user.headers, json={})
        assert response.status_code == 200, response.text
        tokens.append(response.json()["undo_token"])
    for user, token in zip(survivors, tokens, strict=False):  # nobody undoes another's clear
        undo = client.post("/clear/undo", headers=user.headers, json={"undo_token": token})
        assert_error(undo, 404, "undo_token")
        cases += 1
    # Another user's export imported by someone else: a copy for the importer, nothing moved.
    importer = User("import'; --", 99)
    exported = client.get("/export", headers=survivors[0].headers).content
    response = client.post("/import", headers=importer.headers, content=exported)
    assert response.status_code == 200, response.text
    wait_for_jobs(proxy)
    assert counts(proxy, [importer])[importer.uid][:4] == before[survivors[0].uid][:4]
    now = counts(proxy, users)
    for user in users:
        after = now[user.uid]
        if user in doomed:
            assert after == (0, 0, 0, 0, 0), (user.uid, after)
        else:
            assert after == before[user.uid], (user.uid, before[user.uid], after)
            cases += check_recall(proxy, upstream, user)
        cases += 1
    case_counts[f"isolation, lexical path: {len(users)} users, checks"] += cases


def test_dense_path_isolates_recall_and_search(
    api: Callable[..., tuple[RunningProxy, httpx.Client]], upstream: ScriptedUpstream,
    embedder: Any, case_counts: Counter[str],
) -> None:
    proxy, client = api(weight_bm25=0.0)
    users = make_users(seed=2)
    seed(proxy, client, users)
    cases = check_vector_layer(proxy, embedder, users)
    cases += sum(check_recall(proxy, upstream, u) for u in users)
    cases += sum(check_search(client, u) for u in users if not u.via_body)
    case_counts[f"isolation, dense path: {len(users)} users, checks"] += cases


def test_ids_a_header_cannot_carry_are_rejected_with_an_envelope(
    proxy: RunningProxy, case_counts: Counter[str]
) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    for raw in REJECTED_HEADER_IDS:
        for name in ("X-Memory-User-Id", "X-Memory-Session-Id"):
            response = httpx.post(f"{proxy.base_url}/chat/completions", json=body,
                                  headers={name.encode(): raw})
            assert_error(response, 400, name)
        response = httpx.get(f"{proxy.url}/v1/memory/facts", headers={b"X-Memory-User-Id": raw})
        # Memory is off on this proxy: the id is checked first all the same.
        assert_error(response, 400, "X-Memory-User-Id")
    case_counts["isolation: rejected ids"] += len(REJECTED_HEADER_IDS) * 3


IDS = st.text(st.characters(codec="utf-8"), min_size=1,
              max_size=24).map(str.strip).filter(lambda s: bool(s) and s.isprintable())


@pytest.fixture
def shared(start_proxy: Callable[..., RunningProxy]) -> tuple[RunningProxy, dict[str, str]]:
    """One proxy for all of a property's examples, and which user each secret belongs to."""
    return start_proxy(memory=True, **QUIET), {}


@pytest.mark.fuzz
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(a=IDS, b=IDS)
def test_generated_ids_never_see_each_other(
    shared: tuple[RunningProxy, dict[str, str]], case_counts: Counter[str], a: str, b: str
) -> None:
    proxy, owners = shared
    writer, reader = User(a, 1000 + len(owners)), User(b, 0)
    response = chat(proxy, writer, f"My favourite island is {writer.island}.", "shared")
    assert response.status_code == 200, response.text
    owners[writer.island] = a
    wait_for_jobs(proxy)
    with httpx.Client(base_url=f"{proxy.url}/v1/memory", timeout=60) as api:
        for user in (writer, reader):
            dry = chat(proxy, user, QUERY, "asking", **{"X-Memory-Dry-Run": "on"}).json()
            found = api.post("/search", headers=user.headers, json={"query": QUERY}).json()
            export = api.get("/export", headers=user.headers).text
            for text in (dry["block"], found["block"], export):
                assert {owners[m] for m in marks(text)} <= {user.uid}, (user.uid, text)
        assert writer.island in marks(found["block"] if a == b else
                                          api.post("/search", headers=writer.headers,
                                                   json={"query": QUERY}).json()["block"])
    case_counts["isolation: generated id pairs"] += 1


def test_keys_bound_to_users_reach_their_own_memory_only(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    keys = (ApiKey("key-alice", "alice"), ApiKey("key-bob", "bob"))
    proxy = start_proxy(memory=True, api_keys=keys, admin_key="key-admin", **QUIET)
    alice, bob = User("alice", 1), User("bob", 2)
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        for user in (alice, bob):
            response = http.post("/v1/chat/completions", headers=_bearer(user), json={
                "model": "gpt-4o",
                "messages": [{"role": "user", "content": f"My favourite island is {user.island}."}],
            })
            assert response.status_code == 200, response.text
        wait_for_jobs(proxy)
        # A failed job's error can quote what it worked on; the job queue is shared.
        sql_query(
            proxy.state.settings,
            "INSERT INTO jobs (kind, payload, status, attempts, max_attempts, run_after,"
            " last_error, created_at, updated_at) VALUES ('extract_facts', '{}', 'dead', 5,"
            f" 5, 0, 'model said: {alice.island}', 0, 0)",
        )
        for path in ("/v1/memory/stats", "/v1/memory/export", "/v1/memory/facts",
                     "/v1/memory/sessions", "/v1/memory/metrics"):
            seen = http.get(path, headers=_bearer(bob))
            assert seen.status_code == 200 and alice.island not in seen.text, (path, seen.text)
        found = http.post("/v1/memory/search", headers=_bearer(bob), json={"query": QUERY})
        assert marks(found.json()["block"]) == {bob.island}
        assert_error(http.get("/v1/memory/export", headers={
            **_bearer(bob), "X-Memory-User-Id": "alice"}), 403, "X-Memory-User-Id")
        admin = http.get("/v1/memory/stats", headers={
            "Authorization": "Bearer key-admin", "X-Memory-User-Id": "bob"}).json()
        assert [d["error"] for d in admin["jobs"]["dead_letters"]] == [f"model said: {alice.island}"]


def _bearer(user: User) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{user.uid}"}
