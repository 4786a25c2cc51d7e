"""Scale-out storage: memproxy on a Chroma server instead of embedded Chroma, and replicas
sharing PostgreSQL and a Chroma server (through chats and through /mcp)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.mcp_client import mcp_session, structured
from tests.support.memory import QUIET
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream, chat_completion
from tests.support.servers import ChromaServer, PostgresServer
from tests.support.sql import query
from tests.test_memory_flow import system_text

pytestmark = pytest.mark.replicas


def test_memory_on_a_chroma_server_is_recalled_and_survives_a_restart(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    chroma_server: ChromaServer,
) -> None:
    first = start_proxy(memory=True, chroma_url=chroma_server.url)
    upstream.enqueue(JSONReply(chat_completion("Noted.")))
    chat(first, "The billing service runs on Postgres 16.", user="ada", session="s1")
    wait_for_jobs(first)
    assert first.state.memory.vectors.count({"user_id": "ada"}) >= 1
    first.stop()

    # Dense search only, straight on the server: nothing but the server's vectors can find it.
    second = start_proxy(memory=True, chroma_url=chroma_server.url, vector_cache_mb=0,
                         weight_bm25=0.0)
    raw = chat(second, "Which database does billing use?", user="ada", session="s2")

    assert "x-memory-error" not in raw.headers
    assert "runs on Postgres 16" in system_text(upstream.history[-1])


def test_two_replicas_on_postgres_log_a_resent_history_once_and_recall_each_others_memory(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream,
    chroma_server: ChromaServer, postgres_server: PostgresServer,
) -> None:
    shared = {"chroma_url": chroma_server.url, "database_url": postgres_server.create_database()}
    replicas = [start_proxy(memory=True, **shared), start_proxy(memory=True, **shared)]
    said = "Our deploys go out on Tuesdays from the release-train branch."

    # A client resending the same conversation, spread over both replicas at once.
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: chat(replicas[i % 2], said, user="ada", session="s1"),
                                range(8)))
    assert all(reply.status == 200 and "x-memory-error" not in reply.headers for reply in replies)
    for replica in replicas:
        wait_for_jobs(replica)
    rows = query(replicas[0].state.settings,
                 "SELECT role, COUNT(*) FROM turns WHERE user_id = 'ada' GROUP BY role ORDER BY role")
    assert rows == [("assistant", 1), ("user", 1)]  # the scripted upstream's reply is the same
    # Each new turn was queued for indexing once (the question with its request, the reply
    # after it), and every job ran.
    jobs = query(replicas[1].state.settings, "SELECT payload, status FROM jobs WHERE kind = 'index'")
    indexed = sorted(i for payload, _ in jobs for i in json.loads(payload)["turn_ids"])
    assert indexed == [i for (i,) in query(replicas[1].state.settings, "SELECT id FROM turns ORDER BY id")]
    assert {status for _, status in jobs} == {"done"}

    for replica in replicas:
        chat(replica, "Which branch do deploys go out from?", user="ada", session="s2")
        assert "release-train branch" in system_text(upstream.history[-1])


async def test_two_replicas_share_mcp_memory_add_on_one_search_and_delete_on_the_other(
    start_proxy: Callable[..., RunningProxy], chroma_server: ChromaServer,
    postgres_server: PostgresServer,
) -> None:
    shared = {"chroma_url": chroma_server.url, "database_url": postgres_server.create_database(),
              "api_keys": "key-ada-000001:ada", "upstream_api_key": "sk-up", **QUIET}
    # The second replica searches by vectors alone, straight on the Chroma server (no BM25,
    # no local cache): only the shared stores can answer it.
    first = start_proxy(memory=True, **shared)
    second = start_proxy(memory=True, vector_cache_mb=0, weight_bm25=0.0, **shared)
    note = "User's build cache lives on the NAS under /volume1/ccache."

    async with mcp_session(first, key="key-ada-000001", name="editor-a") as client:
        added = structured(await client.call_tool("add_memory", {"text": note}))
    wait_for_jobs(first)  # the fact's vectors are written by its sync job
    async with mcp_session(second, key="key-ada-000001", name="editor-b") as client:
        found = structured(await client.call_tool(
            "search_memory", {"query": "Where is the compiler cache stored?"}))
        assert [item["id"] for item in found["items"] if item["kind"] == "fact"] == [added["id"]]
        assert "/volume1/ccache" in found["block"]
        structured(await client.call_tool("delete_memory", {"id": added["id"]}))
    wait_for_jobs(second)
    async with mcp_session(first, key="key-ada-000001") as client:
        again = structured(await client.call_tool(
            "search_memory", {"query": "Where is the compiler cache stored?"}))
        assert again["items"] == [] and "ccache" not in again["block"]
