"""The organisation scope: shared knowledge every member's requests recall after their own
memory, written only through the memory API by a key allowed to, and never a way to reach
another user's private memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from config.routing import parse_api_keys
from memory import organization_memory
from memory.recall.block import SHARED_HEADING, pack_block
from memory.recall.learned_recall import Learned, LearnedItem
from memory.recall.render import Entry
from memory.tokens import count_tokens
from proxy.access.identity import resolve_user
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET, assert_error, memory_api
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.sql import query
from tests.test_cli_memory import run, run_json
from tests.test_stable_injection import cache_counts

KEYS = ",".join([
    "key-writer-0001:org=acme:org-writer",  # names acme's members, writes acme's memory
    "key-alice-0001:alice:org=acme",
    "key-bob-00001:bob:org=acme",
    "key-carol-0001:carol:org=globex",
    "key-dave-00001:dave",  # a user in no organisation
    "key-plain-0001",  # bound to nobody: names any user
])
ADMIN = "key-admin-0001"
pytestmark = pytest.mark.both_backends

SHARED = "The staging cluster is called Bluebird."
PRIVATE = "Alice keeps her locker code 4417 in the drawer."
QUESTION = "What is the staging cluster called, and what is the locker code in the drawer?"


@pytest.fixture
def acme(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    """A proxy with acme's shared fact and one private fact of alice's."""
    proxy = start_proxy(memory=True, api_keys=KEYS, admin_key=ADMIN, **QUIET)
    with api(proxy, "key-writer-0001", org="acme") as writer:
        assert writer.post("/facts", json={"text": SHARED, "category": "context"}).status_code == 201
    with api(proxy, "key-alice-0001") as alice:
        assert alice.post("/facts", json={"text": PRIVATE, "category": "context"}).status_code == 201
    # Settled, retries after an outage included: a write during a test would change the
    # memory versions its recall cache is stamped with.
    wait_for_jobs(proxy, later=True)
    return proxy


def api(proxy: RunningProxy, key: str, *, org: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"}
    return memory_api(proxy, **headers, **({"X-Memory-Org-Id": org} if org else {}))


def dry_run(proxy: RunningProxy, key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{proxy.base_url}/chat/completions", timeout=60,
        headers={"Authorization": f"Bearer {key}", "X-Memory-Dry-Run": "on", **headers},
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": QUESTION}]},
    )


def block_of(proxy: RunningProxy, key: str, **headers: str) -> str:
    response = dry_run(proxy, key, **headers)
    assert response.status_code == 200, response.text
    assert response.json()["errors"] == []
    block: str = response.json()["block"]
    return block


def test_every_member_recalls_the_shared_fact_after_their_own_memory(acme: RunningProxy) -> None:
    alice = block_of(acme, "key-alice-0001")
    assert "Bluebird" in alice and "4417" in alice
    assert alice.index(SHARED_HEADING) > alice.index("4417")  # after the user's own memory
    sources = {item["source"] for item in dry_run(acme, "key-alice-0001").json()["items"]}
    assert "organization" in sources

    bob = block_of(acme, "key-bob-00001")
    assert "Bluebird" in bob and "4417" not in bob  # a colleague's private memory stays hers

    assert "Bluebird" not in block_of(acme, "key-alice-0001", **{"X-Memory-Scope": "user"})


def test_no_one_outside_the_organisation_recalls_it(acme: RunningProxy) -> None:
    for key in ("key-carol-0001", "key-dave-00001"):
        block = block_of(acme, key)
        assert "Bluebird" not in block and "4417" not in block
    # A key's organisation cannot be swapped for another by a header.
    assert_error(dry_run(acme, "key-carol-0001", **{"X-Memory-Org-Id": "acme"}), 403,
                 "X-Memory-Org-Id")
    assert_error(dry_run(acme, "key-dave-00001", **{"X-Memory-Org-Id": "acme"}), 403,
                 "X-Memory-Org-Id")
    with api(acme, "key-carol-0001", org="acme") as carol:
        assert_error(carol.get("/facts"), 403, "X-Memory-Org-Id")


def test_only_an_org_writer_or_the_admin_changes_shared_memory(acme: RunningProxy) -> None:
    fact = {"text": "Deploys freeze on Fridays.", "category": "decision"}
    with api(acme, "key-alice-0001", org="acme") as alice:
        listed = alice.get("/facts").json()["data"]  # members read it
        assert [f["text"] for f in listed] == [SHARED]
        assert_error(alice.post("/facts", json=fact), 403, "X-Memory-Org-Id")
        assert_error(alice.delete(f"/facts/{listed[0]['id']}"), 403, "X-Memory-Org-Id")
        assert_error(alice.post("/clear"), 403, "X-Memory-Org-Id")
        # Shared memory has facts, no turns, sessions or profile.
        assert_error(alice.get("/turns"), 400, "X-Memory-Org-Id")
        assert_error(alice.get("/sessions"), 400, "X-Memory-Org-Id")
    with api(acme, ADMIN, org="acme") as admin:
        assert admin.post("/facts", json=fact).status_code == 201
    with api(acme, "key-writer-0001", org="acme") as writer:
        assert writer.delete(f"/facts/{listed[0]['id']}").status_code == 200
        assert [f["text"] for f in writer.get("/facts").json()["data"]] == [fact["text"]]
    with api(acme, "key-alice-0001") as alice_own:  # her own facts never held the shared one
        assert [f["text"] for f in alice_own.get("/facts").json()["data"]] == [PRIVATE]


def test_no_request_names_shared_memory_as_its_user(acme: RunningProxy) -> None:
    # A body id is trimmed, and the mark counts as whitespace: this is user "org:acme".
    assert resolve_user({}, {"user": organization_memory("acme")}, None) == "org:acme"
    reply = httpx.post(
        f"{acme.base_url}/chat/completions", timeout=30,
        headers={"Authorization": "Bearer key-plain-0001"},
        json={"model": "gpt-4o", "user": organization_memory("acme"),
              "messages": [{"role": "user", "content": "The staging cluster is now Redbird."}]},
    )
    assert reply.status_code == 200, reply.text
    # A header cannot carry the mark at all: the HTTP parser refuses control characters.
    assert httpx.post(
        f"{acme.base_url}/chat/completions", timeout=30,
        headers={"Authorization": "Bearer key-plain-0001",
                 "X-Memory-User-Id": organization_memory("acme")},
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
    ).status_code == 400
    wait_for_jobs(acme)
    turns = query(acme.state.settings, "SELECT DISTINCT user_id FROM turns")
    assert [row[0] for row in turns] == ["org:acme"]
    owners = query(acme.state.settings, "SELECT DISTINCT user_id FROM facts ORDER BY user_id")
    assert [row[0] for row in owners] == [organization_memory("acme"), "alice"]


def test_keys_off_the_org_comes_from_the_header(start_proxy: Callable[..., RunningProxy]) -> None:
    proxy = start_proxy(memory=True, **QUIET)
    with memory_api(proxy, **{"X-Memory-Org-Id": "acme"}) as local:  # loopback, keys off
        assert local.post("/facts", json={"text": SHARED, "category": "context"}).status_code == 201
    wait_for_jobs(proxy)
    assert "Bluebird" in block_of(proxy, "none", **{"X-Memory-Org-Id": "acme"})
    assert "Bluebird" not in block_of(proxy, "none", **{"X-Memory-Org-Id": "globex"})
    assert "Bluebird" not in block_of(proxy, "none")


def test_the_cli_writes_and_reads_shared_memory(
    acme: RunningProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(capsys, acme, "memories", "add", "Deploys freeze on Fridays.",
                         "--category", "decision", "--org", "acme", "--key", "key-alice-0001")
    assert status == 1 and "403" in err  # a member, not a writer
    assert run(capsys, acme, "memories", "add", "Deploys freeze on Fridays.", "--category",
               "decision", "--org", "acme", "--key", "key-writer-0001")[0] == 0
    listed = run_json(capsys, acme, "memories", "list", "--org", "acme", "--key", "key-bob-00001")
    assert sorted(f["text"] for f in listed) == ["Deploys freeze on Fridays.", SHARED]


def _item(source: str, key: str, text: str) -> LearnedItem:
    return LearnedItem(source, key, text, "context", "s1", 1_700_000_000.0, [])


@pytest.mark.parametrize("budget", [120, 300, 1000])
def test_the_organisation_keeps_its_share_of_the_budget(budget: int) -> None:
    def count(text: str) -> int:
        return count_tokens(text, "gpt-4o")

    own = [_item("fact", f"f{i}", f"User fact number {i} about the billing rollout plan.")
           for i in range(40)]
    shared = [_item("organization", f"f{100 + i}", f"Team rule {i}: deploys need two reviews.")
              for i in range(80)]
    turns = [Entry("user", 1_700_000_000.0 + i, f"turn {i} about the rollout", "s1", i)
             for i in range(80)]
    packed = pack_block(Learned(facts=own, shared=shared), turns, budget, count, shared_share=0.25)
    assert packed.tokens == count(packed.block) <= budget
    shared_lines = [line for line in packed.block.splitlines() if "Team rule" in line]
    assert len(shared_lines) == len(packed.shared) >= 1
    assert sum(count(line) + 1 for line in shared_lines) <= 0.25 * budget
    # With no share of its own, the organisation gets only what the user's memory leaves.
    none = pack_block(Learned(facts=own, shared=shared), turns, budget, count)
    assert none.shared == [] and SHARED_HEADING not in none.block


def test_key_grammar() -> None:
    keys = parse_api_keys("k-plain-001,k-user-001:u1,k-org-0001:u2:org=acme,"
                          "k-writer-01:org=acme:org-writer,k-colon-01:a:b:org=x")
    got: list[Any] = [(k.user_id, k.org_id, k.org_writer) for k in keys]
    assert got == [(None, None, False), ("u1", None, False), ("u2", "acme", False),
                   (None, "acme", True), ("a:b", "x", False)]
    for bad in ("k-writer-01:org-writer", "k-org-0001:org=" + "x" * 257, "k-org-0001:org=a\x01"):
        with pytest.raises(ValueError):
            parse_api_keys(bad)


def test_a_change_to_shared_memory_reaches_every_member_at_once(
    acme: RunningProxy, upstream: ScriptedUpstream
) -> None:
    history = [{"role": "user", "content": QUESTION}]
    first = chat(acme, history, session="b1", api_key="key-bob-00001")
    assert "Bluebird" in str(upstream.history[-1].json["messages"])
    wait_for_jobs(acme, later=True)  # bob's turns stored and indexed: his session's own writes
    before = cache_counts(acme)
    chat(acme, history, session="b1", api_key="key-bob-00001")  # a retry: the kept recall
    assert cache_counts(acme) == (before[0] + 1, before[1])
    with api(acme, "key-writer-0001", org="acme") as writer:
        fact_id = writer.get("/facts").json()["data"][0]["id"]
        assert writer.delete(f"/facts/{fact_id}").status_code == 200
    # Only the organisation's memory changed, yet bob's kept recall is not used again, and
    # his session's stored block, which showed the fact, is not put back.
    chat(acme, history, session="b1", api_key="key-bob-00001")
    assert cache_counts(acme)[1] == before[1] + 1
    assert "Bluebird" not in str(upstream.history[-1].json["messages"])
    chat(acme, [*history, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "And who keeps the drawer?"}],
         session="b1", api_key="key-bob-00001")
    assert "Bluebird" not in str(upstream.history[-1].json["messages"])
