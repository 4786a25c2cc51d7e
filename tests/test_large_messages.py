"""What a huge message costs a real `memproxy serve` process in memory, once its work is done.

One 2 MB message used to grow the server by 1.1 GB of RSS for good: its index job embedded
100 chunks of 256 tokens 32 at a time, onnxruntime's arena kept that peak, and glibc kept
the text's freed buffers. Now a run of the model is bounded and hands its memory back, and
the heap is trimmed after large index work (docs/benchmarks.md, "Large messages").
scripts/soak.py measures ten such messages; this test one, against the same bound.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from memory.index.heap_fill import release_free_heap
from memory.tokens import count_tokens
from scripts.soak_large import LARGE_RSS_LIMIT_MB, large_text
from tests.support.jobs import wait_for_jobs
from tests.support.processes import Process, launch, memproxy_env, wait_ready
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream, chat_completion
from tests.support.sql import scalar

SETTLE_SECONDS = 3.0


def rss_mb(process: Process) -> float:
    for line in Path(f"/proc/{process.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(upstream: ScriptedUpstream, tmp_path: Path) -> Iterator[Process]:
    process = launch(memproxy_env(upstream.base_url, log_level="warning"), tmp_path / "data",
                     tmp_path / "memproxy.log")
    try:
        wait_ready(process)
        yield process
    finally:
        process.popen.kill()
        process.popen.wait(10)


def chat(process: Process, user: str, text: str) -> httpx.Response:
    return httpx.post(f"{process.url}/v1/chat/completions", timeout=120, headers={
        "X-Memory-User-Id": user}, json={"model": "gpt-4o-mini",
                                         "messages": [{"role": "user", "content": text}]})


def settled_rss(process: Process, turns: int) -> float:
    """RSS once the requests' `turns` are stored and every job is done."""
    db = process.data_dir / "memproxy.db"
    deadline = time.monotonic() + 60
    while scalar(db, "SELECT count(*) FROM turns") < turns:
        assert time.monotonic() < deadline, process.output()
        time.sleep(0.1)
    wait_for_jobs(db, timeout=300)
    time.sleep(SETTLE_SECONDS)
    return rss_mb(process)


@pytest.mark.process
def test_a_2_mb_message_leaves_the_server_near_its_idle_size(
    server: Process, upstream: ScriptedUpstream
) -> None:
    for i in range(3):  # warm: the model's first runs, the first user's vectors
        assert chat(server, f"warm-{i}", f"Hello, this is warm-up message {i}.").status_code == 200
    idle = settled_rss(server, 6)
    upstream.enqueue(JSONReply(chat_completion("Noted, that is a long document.")))
    text = large_text(random.Random(1), 2_000_000)
    answer = chat(server, "big", text)
    assert answer.status_code == 200 and "x-memory-error" not in answer.headers, answer.text
    after = settled_rss(server, 8)
    assert after - idle < LARGE_RSS_LIMIT_MB, (idle, after, server.output())
    # Counted and chunked in a worker thread (memory.tokens.off_loop), as a short turn is inline.
    db = server.data_dir / "memproxy.db"
    stored = "SELECT tokens FROM turns WHERE user_id = 'big' AND role = 'user'"
    assert scalar(db, stored) == count_tokens(text, "gpt-4o-mini")
    assert scalar(db, "SELECT count(*) FROM chunks WHERE user_id = 'big'") >= 100


def test_freed_heap_is_handed_back() -> None:
    """glibc's trim finds the pages freed inside the heap (a large buffer's free raises its
    mmap threshold, so the next ones come from the heap, as a large text's do)."""
    first = bytearray(8 << 20)
    del first
    buffers = [bytearray(512 << 10) for _ in range(64)]
    del buffers[:-1]
    assert release_free_heap()
