"""The JavaScript SDKs as real clients of memproxy: openai-node's Responses API, and the MCP
TypeScript SDK's client on /mcp.

`.ci/run` installs the SDKs with `npm ci --prefix tests/node` (the lock file is committed).
Without node or an SDK the test is skipped locally and fails under CI=1.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningProxy
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET
from tests.support.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.node

NODE_DIR = Path(__file__).resolve().parent / "node"


def node(package: str = "openai") -> str:
    """The node binary, once the SDK `package` is installed; else skip (fail under CI)."""
    binary = shutil.which("node")
    if binary is None:
        missing = "node is not installed"
    elif not (NODE_DIR / "node_modules" / package / "package.json").is_file():
        missing = f"{package} is not installed: npm ci --prefix tests/node"
    else:
        return binary
    if os.environ.get("CI"):
        pytest.fail(missing)
    pytest.skip(missing)


def test_openai_node_responses_create_and_stream_with_memory(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream
) -> None:
    binary = node()
    proxy = start_proxy(memory=True)
    httpx.post(f"{proxy.base_url}/chat/completions", headers={"X-Memory-User-Id": "ada"},
               timeout=20, json={"model": "gpt-4o", "messages": [
                   {"role": "user", "content": "I play the cello in the Lisbon youth orchestra."}]})
    wait_for_jobs(proxy)
    result = subprocess.run(
        [binary, str(NODE_DIR / "responses.mjs"), proxy.base_url, "ada",
         "Which instrument do I play?", "Thanks! And which orchestra?"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["created"] == "echo: Which instrument do I play?"
    assert out["streamed"] == out["final"] == "echo: Thanks! And which orchestra?"
    sent = [r.json for r in upstream.history if r.path == "/v1/responses"]
    assert "cello" in sent[0]["instructions"]  # recalled from the chat completion
    assert sent[1]["previous_response_id"] == out["id"] and sent[1]["stream"] is True
    wait_for_jobs(proxy)
    with closing(sqlite3.connect(proxy.state.settings.db_path)) as conn:
        rows = conn.execute("SELECT session_id, content FROM turns WHERE user_id = 'ada'"
                            " ORDER BY id").fetchall()
    chained = [content for session, content in rows if session == rows[2][0]]
    # The continuation joins the first request's session; the helper's stream starts anew.
    assert chained == ["Which instrument do I play?", out["created"],
                       "Thanks! And which orchestra?", out["streamed"]]


MCP_TOOLS = {
    "search_memory", "add_memory", "list_memories", "delete_memory", "undo_delete", "read_profile",
}


def test_the_mcp_typescript_sdk_calls_every_tool_and_gets_the_errors(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    binary = node("@modelcontextprotocol/sdk")
    proxy = start_proxy(memory=True, api_keys="key-node-00001:ada", upstream_api_key="sk-up",
                        **QUIET)
    result = subprocess.run(
        [binary, str(NODE_DIR / "mcp.mjs"), proxy.url, "key-node-00001"],
        capture_output=True, text=True, timeout=90, check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    tools = {tool["name"]: tool for tool in out["tools"]}
    assert set(tools) == MCP_TOOLS and all(t["hasOutputSchema"] for t in tools.values())
    assert tools["search_memory"]["readOnly"] and tools["delete_memory"]["destructive"]
    added = out["added"]  # the SDK checked every structured result against its output schema
    assert added["id"].startswith("f") and added["source"] == "mcp" and added["client"]
    assert added["id"] in [item["id"] for item in out["found"]["items"]]
    assert "NixOS" in out["found"]["block"]
    assert [item["id"] for item in out["listed"]["items"]] == [added["id"]]
    deleted = out["deleted"]
    assert {k: deleted[k] for k in ("id", "deleted", "shared")} == {
        "id": added["id"], "deleted": True, "shared": False}
    assert out["after"]["items"] == []
    assert out["undone"] == {"restored": True, "added": {"facts": 1}}
    assert [item["text"] for item in out["restored"]["items"]] == [added["text"]]
    assert out["badArguments"]["isError"] and "text must be a string" in out["badArguments"]["text"]
    assert out["unknownTool"]["code"] == -32602 and "unknown tool" in out["unknownTool"]["message"]
    assert out["wrongKey"]["code"] == 401 and "invalid_api_key" in out["wrongKey"]["message"]
    facts = httpx.get(f"{proxy.url}/v1/memory/facts", timeout=30,
                      headers={"Authorization": "Bearer key-node-00001"}).json()["data"]
    # Nothing the bad calls sent was stored: the one fact is the restored one.
    assert [fact["text"] for fact in facts] == [added["text"]]
