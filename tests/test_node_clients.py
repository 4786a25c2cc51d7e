"""openai-node's Responses API against memproxy: the JavaScript SDK as a real client.

`.ci/run` installs the SDK with `npm ci --prefix tests/node` (the lock file is committed).
Without node or the SDK the test is skipped locally and fails under CI=1.
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
from tests.support.scripted_upstream import ScriptedUpstream

NODE_DIR = Path(__file__).resolve().parent / "node"


def node() -> str:
    """The node binary, once the SDK is installed; else skip (fail under CI)."""
    binary = shutil.which("node")
    if binary is None:
        missing = "node is not installed"
    elif not (NODE_DIR / "node_modules" / "openai" / "package.json").is_file():
        missing = "openai-node is not installed: npm ci --prefix tests/node"
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
