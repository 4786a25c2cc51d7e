"""What a new user tripped on (issues 27 and 39): headers on errors, settings, the block's shape."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support.scripted_upstream import Drop, ErrorReply, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
    ("/v1/chat/completions", {"model": "m", "messages": MESSAGES, "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hello"}),
])
def test_a_502_carries_the_session_id(
    client: httpx.Client, upstream: ScriptedUpstream, path: str, body: dict[str, object]
) -> None:
    upstream.enqueue(Drop(), Drop())
    headers = {"x-memory-session-id": "s-502", "authorization": "Bearer sk-test-key"}
    response = client.post(path, json=body, headers=headers)
    assert response.status_code == 502, response.text
    assert response.headers["x-memory-session-id"] == "s-502"


def test_a_502_on_the_anthropic_upstream_carries_the_session_id(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(anthropic_base_url=upstream.base_url)
    upstream.enqueue(Drop(), Drop())
    response = httpx.post(f"{proxy.url}/v1/messages", headers={"x-memory-session-id": "s-a"},
                          json={"model": "claude-x", "max_tokens": 10, "messages": MESSAGES})
    assert response.status_code == 502, response.text
    assert response.headers["x-memory-session-id"] == "s-a"


def test_an_upstream_error_status_carries_the_session_id(
    client: httpx.Client, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(ErrorReply(503, "busy"))
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert response.status_code == 503
    assert response.headers["x-memory-session-id"]


def test_a_400_before_identity_has_no_session_header(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", content=b"{nope")
    assert response.status_code == 400
    assert "x-memory-session-id" not in response.headers


def test_short_keys_are_documented() -> None:
    from pathlib import Path

    from config.settings import setting_fields

    help_text = next(f for f in setting_fields() if f.name == "api_keys").metadata["help"]
    assert "8 characters" in help_text
    # Where the docs say who the user is and what a key binds (docs/headers.md).
    page = (Path(__file__).parent.parent / "docs" / "headers.md").read_text()
    assert "at least 8 characters" in page




def test_the_block_without_facts_keeps_the_documented_turns_heading() -> None:
    from memory import count_tokens
    from memory.recall.block import TURNS_HEADING, pack_block
    from memory.recall.learned_recall import Learned
    from memory.recall.render import CLOSE, OPEN, Entry

    def count(text: str) -> int:
        return count_tokens(text, "gpt-4o")

    day = 1_700_000_000.0
    entries = [Entry("user", day, "I adopted a greyhound.", "s1", 1),
               Entry("assistant", day + 5, "Lovely dog.", "s1", 2)]
    packed = pack_block(Learned(), entries, 1000, count)
    lines = packed.block.splitlines()
    assert lines[0] == OPEN and lines[-1] == CLOSE
    assert lines[2:] == [TURNS_HEADING, "[2023-11-14]", "user: I adopted a greyhound.",
                         "assistant: Lovely dog.", CLOSE]
    assert packed.tokens == count(packed.block)
    for budget in range(0, packed.tokens + 3):
        small = pack_block(Learned(), entries, budget, count)
        assert small.tokens == count(small.block) <= budget
        assert not small.block or TURNS_HEADING in small.block


# -- item 5: configuration -------------------------------------------------------------------


def test_a_misspelt_variable_is_named_with_the_nearest_known_one() -> None:
    from config.settings import unknown_env_warnings

    warnings = unknown_env_warnings({
        "MEMPROXY_UPSTREAM_BASEURL": "http://x", "MEMPROXY_PORT": "1",
        "MEMPROXY_CONFIG": "a.toml", "MEMPROXY_URL": "http://y", "MEMPROXY_KEY": "k",
        "MEMPROXY_XYZZY": "1", "OTHER_PORT": "2",
    })
    assert len(warnings) == 2, warnings
    assert "MEMPROXY_UPSTREAM_BASEURL" in warnings[0]
    assert "MEMPROXY_UPSTREAM_BASE_URL" in warnings[0]
    assert "MEMPROXY_XYZZY" in warnings[1] and "did you mean" not in warnings[1]


def _serve(tmp_path: Path, env: dict[str, str], *args: str, wait: float = 60.0) -> tuple[int | None, str]:
    """Run `memproxy serve` until it is ready (then stop it) or exits; (exit code, output)."""
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT
    from tests.support.servers import free_port

    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        popen = subprocess.Popen([sys.executable, "-m", "proxy", "serve", *args],
                                 cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + wait
    code: int | None = None
    try:
        while time.monotonic() < deadline:
            code = popen.poll()
            if code is not None:
                break
            if "memproxy ready" in log.read_text(errors="replace"):
                break
            time.sleep(0.1)
    finally:
        if popen.poll() is None:
            popen.terminate()
            popen.wait(30)
    del port
    return code, log.read_text(errors="replace")


@pytest.fixture
def serve_env(tmp_path: Path, upstream: ScriptedUpstream) -> dict[str, str]:
    from tests.support.processes import memproxy_env

    return {**memproxy_env(upstream.base_url), "MEMPROXY_DATA_DIR": str(tmp_path / "data")}


@pytest.mark.process
def test_serve_warns_of_a_misspelt_variable_and_says_what_it_uses(
    tmp_path: Path, serve_env: dict[str, str]
) -> None:
    from tests.support.servers import free_port

    env = {**serve_env, "MEMPROXY_UPSTREAM_TIMEOUTS": "5"}
    code, output = _serve(tmp_path, env, "--port", str(free_port()))
    assert code is None, output
    assert "MEMPROXY_UPSTREAM_TIMEOUTS" in output and "MEMPROXY_UPSTREAM_TIMEOUT" in output
    ready = next(line for line in output.splitlines() if "memproxy ready" in line)
    assert str(tmp_path / "data" / "memproxy.db") in ready
    assert str(tmp_path / "data" / "vectors") in ready


@pytest.mark.process
def test_a_port_flag_wins_over_a_bad_port_variable(
    tmp_path: Path, serve_env: dict[str, str]
) -> None:
    from tests.support.servers import free_port

    code, output = _serve(tmp_path, {**serve_env, "MEMPROXY_PORT": "0"},
                          "--port", str(free_port()))
    assert code is None, output
    assert "memproxy ready" in output


@pytest.mark.process
def test_a_missing_config_file_names_the_flag(tmp_path: Path, serve_env: dict[str, str]) -> None:
    code, output = _serve(tmp_path, serve_env, "--config", str(tmp_path / "missing.toml"))
    assert code == 2, output
    assert "--config" in output and "MEMPROXY_CONFIG" not in output
    code, output = _serve(tmp_path, {**serve_env, "MEMPROXY_CONFIG": str(tmp_path / "gone.toml")})
    assert code == 2 and "MEMPROXY_CONFIG" in output


def test_the_ready_line_names_postgres_without_its_password() -> None:
    from config import load_settings
    from config.settings import describe_storage

    settings = load_settings(env={
        "MEMPROXY_DATABASE_URL": "postgresql://mem:s3cret-pw@db.internal:5433/memproxy",
        "MEMPROXY_CHROMA_URL": "http://user:chroma-pw@chroma:8000",
    })
    described = describe_storage(settings)
    assert described["database"] == "postgresql://mem@db.internal:5433/memproxy"
    assert described["vectors"] == "chroma server http://user@chroma:8000"
    assert "s3cret" not in str(described) and "chroma-pw" not in str(described)


# -- issue 39 ---------------------------------------------------------------------------------


def test_search_without_the_embedding_model_is_a_503_that_says_why(
    make_settings: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 6: in the documented degraded mode (no model) memory search answered 500; now the
    memory API, the CLI and MCP's search_memory all say what /readyz says, and the fix."""
    from proxy.cli.main import main
    from tests.conftest import serve
    from tests.support.mcp_client import mcp_session

    (tmp_path / "model").mkdir()
    proxy = serve(make_settings(embedding_model_dir=tmp_path / "model"), with_memory=True)
    try:
        ready = httpx.get(f"{proxy.url}/readyz").json()["parts"]["embeddings"]
        assert ready.startswith("error: EmbeddingModelMissing"), ready
        answer = httpx.post(f"{proxy.url}/v1/memory/search", json={"query": "tea"})
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "memory_unavailable" and error["type"] == "api_error"
        assert "embedding model" in error["message"] and "/readyz" in error["message"]
        assert "MEMPROXY_EMBEDDING_MODEL_DIR" in error["message"]

        assert main(["memories", "search", "tea", "--url", proxy.url]) == 1
        said = capsys.readouterr().err.splitlines()[-1]  # after the server's own log lines
        assert said.startswith("memproxy: memory search needs the embedding model"), said
        assert said.endswith("(503 memory_unavailable)"), said

        async def search_memory() -> Any:
            async with mcp_session(proxy.url) as client:
                return await client.call_tool("search_memory", {"query": "tea"})

        result = asyncio.run(search_memory())
        assert result.is_error
        said = str(result.content)
        assert "embedding model" in said and "Internal server error" not in said, said
    finally:
        proxy.stop()


def test_start_up_with_a_store_that_does_not_answer_says_why_in_one_line(
    tmp_path: Path, serve_env: dict[str, str], postgres_server: Any
) -> None:
    """Item 7: a database URL on a closed port, a database that does not exist, a Chroma
    server that is down: one line naming the part and the fix, not 40-110 of traceback."""
    from tests.support.servers import free_port

    closed = free_port()
    missing = postgres_server.create_database().rsplit("/", 1)[0] + "/no_such_db"
    for env, said in [
        ({"MEMPROXY_DATABASE_URL": f"postgresql://mem:pw@127.0.0.1:{closed}/memproxy"},
         f"the database (PostgreSQL at postgresql://mem@127.0.0.1:{closed}/memproxy): no"
         " connection ("),
        ({"MEMPROXY_DATABASE_URL": missing},
         'database "no_such_db" does not exist; create it (createdb) or fix'
         " MEMPROXY_DATABASE_URL"),
        ({"MEMPROXY_CHROMA_URL": f"http://127.0.0.1:{closed}"},
         f"the vectors (Chroma server at http://127.0.0.1:{closed}): no answer"),
    ]:
        code, output = _serve(tmp_path, {**serve_env, **env}, "--port", str(free_port()))
        assert code == 1, output
        assert output.splitlines() == [output.strip()], output
        assert output.startswith("memproxy: cannot start: ") and said in output, output
        assert ":pw@" not in output


def test_an_unsupported_database_or_chroma_url_is_a_settings_error() -> None:
    from config import SettingsError, load_settings

    with pytest.raises(SettingsError) as raised:
        load_settings(env={"MEMPROXY_DATABASE_URL": "mysql://mem:s3cret@db/memproxy",
                           "MEMPROXY_CHROMA_URL": "chroma:8000"})
    said = str(raised.value)
    assert "MEMPROXY_DATABASE_URL: must be a PostgreSQL URL" in said and "s3cret" not in said
    assert "MEMPROXY_CHROMA_URL: must be a Chroma server's http(s) URL" in said
    for good in ("postgresql://mem@db/memproxy", "postgres://db/memproxy"):
        assert load_settings(env={"MEMPROXY_DATABASE_URL": good}).database_url == good


@pytest.mark.both_backends
def test_a_deleted_fact_s_id_is_never_given_to_another(
    start_proxy: Callable[..., RunningProxy]
) -> None:
    """Item 10: on SQLite the next fact took the id of the newest one deleted, so a client
    still holding that id reached another fact."""
    from tests.support.memory import QUIET, memory_api

    proxy = start_proxy(memory=True, **QUIET)
    with memory_api(proxy, **{"X-Memory-User-Id": "ida"}) as api:
        api.post("/facts", json={"text": "Ida keeps bees.", "category": "context"})
        newest = api.post("/facts", json={"text": "Ida's hive is blue.", "category": "context"})
        gone = newest.json()["id"]
        assert api.delete(f"/facts/{gone}").status_code == 200
        added = api.post("/facts", json={"text": "Ida sells honey.", "category": "context"})
        assert added.json()["id"] > gone
        assert api.get(f"/facts/{gone}").status_code == 404


@pytest.mark.both_backends
async def test_a_deleted_summary_s_id_is_never_given_to_another(
    tmp_path: Path, database_url: str | None
) -> None:
    from memory.storage import summaries
    from memory.storage.summaries import NewSummary
    from tests.support.storage import Storage

    def summary(text: str) -> NewSummary:
        return NewSummary("ida", "s1", text, {}, source_turn_ids=[], last_turn_id=0,
                          user_turns=1, tokens=3, created_at=1.0)

    storage = await Storage.open(tmp_path / "memproxy.db", url=database_url)
    try:
        async with storage.db.write() as tx:
            await summaries.insert(tx, summary("Ida keeps bees."))
            gone = await summaries.insert(tx, summary("Ida's hive is blue."))
            assert await summaries.delete(tx, "ida", summary_id=gone) == [gone]
            assert await summaries.insert(tx, summary("Ida sells honey.")) > gone
    finally:
        await storage.close()


def test_0016_keeps_facts_and_summaries_with_their_ids_and_indexes(tmp_path: Path) -> None:
    """An existing database moves to ids that are never reused, keeping every row, its
    full-text index and the largest id used so far."""
    import sqlite3

    from memory.storage import migrations

    conn = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    migrations.apply(conn, [m for m in migrations.MIGRATIONS if m[0] < "0016"])
    for text in ("Ida keeps bees", "Ida's hive is blue"):
        conn.execute(
            "INSERT INTO facts (chain_id, user_id, text, category, confidence, importance,"
            " source, first_seen, last_seen, valid_from, created_at, updated_at, owner)"
            " VALUES (0, 'ida', ?, 'context', 0.6, 5, 'manual', 1, 1, 1, 1, 1, 'o')", (text,))
    attached = conn.execute("SELECT type, name FROM sqlite_master WHERE tbl_name = 'facts'"
                            " AND type IN ('index', 'trigger') ORDER BY name").fetchall()
    assert migrations.apply(conn) == ["0016_lasting_ids"]
    assert conn.execute("SELECT type, name FROM sqlite_master WHERE tbl_name = 'facts'"
                        " AND type IN ('index', 'trigger') ORDER BY name").fetchall() == attached
    conn.execute("DELETE FROM facts WHERE id = 2")
    conn.execute(
        "INSERT INTO facts (chain_id, user_id, text, category, confidence, importance,"
        " source, first_seen, last_seen, valid_from, created_at, updated_at, owner)"
        " VALUES (0, 'ida', 'Ida sells honey', 'context', 0.6, 5, 'manual', 1, 1, 1, 1, 1, 'o')")
    assert conn.execute("SELECT id, text FROM facts ORDER BY id").fetchall() == [
        (1, "Ida keeps bees"), (3, "Ida sells honey")]
    hits = conn.execute("SELECT rowid FROM facts_fts WHERE facts_fts MATCH 'bees OR honey'")
    assert sorted(hits.fetchall()) == [(1,), (3,)]
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.close()


def test_the_admin_key_on_a_chat_says_what_it_is_for(
    start_proxy: Callable[..., RunningProxy], capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 11: the admin key sent to a chat was "incorrect API key"; and the CLI's 401
    said to send a Bearer token where the command line takes --key."""
    from proxy.cli.main import main

    proxy = start_proxy(api_keys="key-alice-0001", admin_key="admin-key-0001")
    answer = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                        headers={"authorization": "Bearer admin-key-0001"})
    assert answer.status_code == 401
    said = answer.json()["error"]["message"]
    assert said.startswith("this is the admin key: it manages memory and keys"), said
    assert "send a proxy key" in said

    assert main(["stats", "--url", proxy.url]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("; give the key with --key or MEMPROXY_KEY"), err


def test_the_command_line_introduces_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """Item 11: `memproxy --version`; bare `memproxy` prints help (it was an error); the
    top-level help names no source files."""
    import importlib.metadata

    from proxy.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"memproxy {importlib.metadata.version('memproxy')}"

    assert main([]) == 0
    bare = capsys.readouterr()
    assert bare.out.startswith("usage: memproxy") and bare.err == ""
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert shown == bare.out and "serve" in shown and "memories" in shown
    assert ".py" not in shown and "proxy/" not in shown, shown


def test_one_of_a_thing_is_said_in_the_singular(
    start_proxy: Callable[..., RunningProxy], capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.cli.main import main
    from proxy.cli.render import count
    from tests.support.memory import QUIET

    assert [count(1, "fact"), count(2, "fact"), count(1, "summary", "summaries"),
            count(0, "summary", "summaries")] == ["1 fact", "2 facts", "1 summary", "0 summaries"]
    proxy = start_proxy(memory=True, **QUIET)
    assert main(["memories", "add", "Ida keeps bees", "--url", proxy.url]) == 0
    assert main(["memories", "search", "who keeps bees?", "--url", proxy.url]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("1 item in block order, "), last


def test_a_404_from_a_base_url_without_its_version_says_so(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    """Item 11: MEMPROXY_UPSTREAM_BASE_URL without /v1 got the upstream's bare 404 (Ollama
    answers "404 page not found" in plain text, OpenAI-like servers an error envelope)."""
    from tests.support.scripted_upstream import RawReply

    assert upstream.base_url.endswith("/v1")
    proxy = start_proxy(upstream_base_url=upstream.base_url.removesuffix("/v1"))
    upstream.enqueue(RawReply(b"404 page not found", status=404, content_type="text/plain"),
                     ErrorReply(404, "Unknown request URL: GET /models."))
    for path, body in (("/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
                       ("/v1/models", None)):
        answer = httpx.request("POST" if body else "GET", f"{proxy.url}{path}", json=body,
                               headers={"authorization": "Bearer sk-test-key"})
        assert answer.status_code == 404, answer.text
        said = answer.json()["error"]["message"]
        assert "base URL usually ends with its version, such as /v1" in said, said
        assert f"memproxy asked {path.removeprefix('/v1')}" in said, said
    assert said.startswith("Unknown request URL: GET /models. (memproxy asked"), said
    # With the version in the base URL, an upstream's own 404 comes back as it was.
    versioned = start_proxy(upstream_base_url=upstream.base_url)
    upstream.enqueue(ErrorReply(404, "The model 'm' does not exist"))
    answer = httpx.post(f"{versioned.url}/v1/chat/completions",
                        json={"model": "m", "messages": MESSAGES},
                        headers={"authorization": "Bearer sk-test-key"})
    assert answer.status_code == 404
    assert answer.json()["error"]["message"] == "The model 'm' does not exist", answer.text
