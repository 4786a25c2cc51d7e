"""Attack: stale heap memory written into embedded Chroma's index files.

hnswlib writes the whole capacity it malloc'd for a new index (room for 100 elements) into
`data_level0.bin` and `length.bin`, set or not (memory/index/heap_fill.py). Whatever the
process's heap held there before (a write-off request's text, another user's, the upstream
key) went to disk, where `X-Memory-Write: off` promises nothing stays.

The attacker's request and the victim's write run in a real `memproxy serve` process with
MALLOC_ARENA_MAX=1: every thread then allocates from one glibc arena, so the chunks the
attacker's text was freed from and the buffer hnswlib takes for the index meet every time
(with the default arenas they meet by luck: 1 run in 6 wrote the text, 5 of 5 did with one
arena, before the fix). The request is large (1 MB) and sent three times: freeing the first
one's copies raises glibc's mmap threshold past them, so the later ones are copied within the
heap and freed there, and the index's 167,600-byte base layer comes from that heap instead of
fresh zeroed pages.
"""

from __future__ import annotations

import platform
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from config import Settings
from memory.index.heap_fill import fill_heap
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.processes import Process, launch, memproxy_env, wait_ready
from tests.support.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.both_backends

MARK = "heap-residue-marker-7Q3"
KEY = f"sk-{MARK}-upstream-key"
WRITE_OFF = {"X-Memory-Write": "off"}
HNSW_BASE_LAYER = 100 * 1676  # hnswlib's first capacity at 384 dimensions, M=16


@pytest.fixture
def process(
    upstream: ScriptedUpstream, tmp_path: Path, database_url: str | None
) -> Iterator[Process]:
    """memproxy with memory on, one malloc arena and the marker as its upstream key."""
    settings = {"memory": "on", "upstream_api_key": KEY}
    if database_url is not None:
        settings["database_url"] = database_url
    env = memproxy_env(upstream.base_url, **settings) | {"MALLOC_ARENA_MAX": "1"}
    running = launch(env, tmp_path / "data", tmp_path / "memproxy.log")
    try:
        wait_ready(running)
        yield running
    finally:
        if running.popen.poll() is None:
            running.popen.kill()
            running.popen.wait(10)


@pytest.mark.process
def test_a_write_off_request_leaves_no_heap_residue_in_the_vector_index(
    process: Process, database_url: str | None
) -> None:
    secret = " ".join([MARK] * (1_000_000 // (len(MARK) + 1)))
    for _ in range(3):  # once the first raised the mmap threshold, its copies use the heap
        chat(f"{process.url}/v1", secret, session="off-eve", user="eve", headers=WRITE_OFF)
    # Another user's turn is indexed: Chroma creates the collection's HNSW index now.
    reply = chat(f"{process.url}/v1", "Our billing service runs on Postgres 16.",
                 session="s-bob", user="bob")
    assert "x-memory-error" not in reply.headers
    target = Settings(database_url=database_url) if database_url else process.data_dir / "memproxy.db"
    wait_for_jobs(target)
    process.popen.send_signal(signal.SIGTERM)  # Chroma writes its files out as it closes
    assert process.popen.wait(60) == 0, process.output()

    files = [path for path in process.data_dir.rglob("*") if path.is_file()]
    base_layers = [path for path in files if path.name == "data_level0.bin"]
    assert base_layers and all(path.stat().st_size >= HNSW_BASE_LAYER for path in base_layers)
    stored = [str(path.relative_to(process.data_dir)) for path in files
              if any(needle in path.read_bytes() for needle in (MARK.encode(), KEY.encode()))]
    assert stored == []


def test_the_operators_own_perturb_setting_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_PERTURB_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert fill_heap() is (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.perturb=0")  # read by glibc at start
    assert fill_heap() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_PERTURB_", "0")
    assert fill_heap() is False
