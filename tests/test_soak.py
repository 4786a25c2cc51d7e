"""scripts/soak.py: a smoke run end to end, and its checks can see a loss."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from memory.storage.turns import NewTurn
from scripts.soak import Failed, Ledger, User, audit, sse_text
from tests.support.storage import Storage

pytestmark = pytest.mark.soak

ROOT = Path(__file__).resolve().parents[1]


def test_a_quick_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "scripts.soak", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout
    figures = orjson.loads(out.read_bytes())
    proxy, audit_ = figures["phases"]["proxy"], figures["audit"]
    assert proxy["sent"] == proxy["ok"] == figures["config"]["requests"] == 120
    assert proxy["ttfb_p50_ms"] > 0 and proxy["total_p50_ms"] > 0  # both kinds ran
    # Every request adds a user turn and its reply: warm-up and soak through the proxy.
    assert audit_["turns_stored"] == audit_["turns_expected"] == 2 * (120 + 20)
    assert audit_["jobs_done"] == audit_["jobs_enqueued"] > 0
    assert audit_["turns_unindexed"] == audit_["turns_missing"] == audit_["turns_extra"] == 0
    assert figures["rss_mb"]["after_warmup"] > 0
    assert figures["added"]["ttfb_p50_ms"] is not None
    large = figures["large"]  # the large-message phase, with small messages in a quick run
    assert large["ok"] == large["messages"] == 2 and large["drained"]
    assert large["rss_idle_mb"] > 0 and large["rss_after_mb"] > 0


async def test_the_audit_finds_missing_and_extra_turns(tmp_path: Path) -> None:
    db = tmp_path / "memproxy.db"
    store = await Storage.open(db)
    user = User("u1", session_id="s1")
    try:
        await store.log.append_turns("u1", "s1", [NewTurn("user", "hi"), NewTurn("assistant", "echo: hi")])
        await store.log.append_turns("u1", "s1", [NewTurn("user", "again")])  # a turn nobody sent
    finally:
        await store.close()
    ledger = Ledger()
    ledger.settled(user, "hi", "echo: hi")
    ledger.settled(user, "lost", "echo: lost")  # sent, never stored
    found = audit(db, ledger)
    assert found["turns_missing"] == 2
    assert found["turns_extra"] == 1
    assert found["jobs_enqueued"] == 2 and found["jobs_done"] == 0
    assert found["turns_unindexed"] == 3
    ledger.failed(User("u1", session_id="s1"), "again")  # a failed request may leave its turn
    assert audit(db, ledger)["turns_extra"] == 0


def test_a_stream_must_end_with_done_and_no_error_event() -> None:
    chunk = b'data: {"choices": [{"delta": {"content": "echo: x"}}]}\n\n'
    assert sse_text(chunk + b"data: [DONE]\n\n") == "echo: x"
    with pytest.raises(Failed, match="without"):
        sse_text(chunk)
    with pytest.raises(Failed, match="error event"):
        sse_text(chunk + b'event: error\ndata: {"error": {"message": "cut"}}\n\n')
