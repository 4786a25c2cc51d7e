"""Scale-out storage: memproxy on a Chroma server instead of embedded Chroma."""

from __future__ import annotations

from collections.abc import Callable

from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream, chat_completion
from tests.support.servers import ChromaServer
from tests.test_memory_flow import system_text


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
