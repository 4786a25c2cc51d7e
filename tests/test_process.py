"""memproxy as a real process (`python -m proxy serve`): kill -9 while it streams and indexes,
then a restart on the same data directory; SIGTERM with streams in flight."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from memory.learning.prompts import EXTRACT_SYSTEM
from memory.storage.turns import NewTurn
from tests.support.jobs import wait_for_jobs
from tests.support.processes import Process, launch, memproxy_env, wait_ready
from tests.support.scripted_upstream import (
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    SSEReply,
    chat_chunks,
    chat_completion,
)
from tests.support.storage import Storage

# Out of the fast lane (CONTRIBUTING.md, `process`): memproxy processes killed and restarted.
pytestmark = pytest.mark.process


@dataclass
class Streamed:
    """A streamed chat completion read in a thread: its SSE data lines and how it ended."""

    lines: list[str] = field(default_factory=list)
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def text(self) -> str:
        pieces = []
        for line in self.lines:
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    pieces.append(choice.get("delta", {}).get("content") or "")
        return "".join(pieces)

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"


@pytest.fixture
def spawn(upstream: ScriptedUpstream, tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """Start memproxy processes on a data dir in tmp_path; any still running is killed at the end."""
    started: list[Process] = []

    def start(data_dir: Path | None = None, **settings: str) -> Process:
        data_dir = data_dir or tmp_path / "data"
        env = memproxy_env(upstream.base_url, **settings)
        process = launch(env, data_dir, tmp_path / f"memproxy-{len(started)}.log")
        started.append(process)
        wait_ready(process)
        return process

    yield start
    for process in started:
        if process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait(10)


def stream_chat(process: Process, content: str, session: str) -> Streamed:
    """Start a streamed chat completion in a thread; returns once its first chunk arrived."""
    streamed = Streamed()

    def run() -> None:
        body = {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": content}]}
        headers = {"X-Memory-Session-Id": session}
        try:
            with httpx.stream("POST", f"{process.url}/v1/chat/completions", json=body,
                              headers=headers, timeout=30) as response:
                for line in response.iter_lines():
                    if line:
                        streamed.lines.append(line)
                        streamed.started.set()
        except httpx.HTTPError as exc:
            streamed.error = exc
        finally:
            streamed.started.set()

    streamed.thread = threading.Thread(target=run, daemon=True)
    streamed.thread.start()
    assert streamed.started.wait(30) and streamed.lines, streamed.error
    return streamed


def scripted_by_message(replies: dict[str, Reply]) -> Callable[[Received], Reply | None]:
    """Answer chat requests by their last user message (concurrent requests, fixed replies)."""

    def respond(received: Received) -> Reply | None:
        if received.path != "/v1/chat/completions" or not isinstance(received.json, dict):
            return None
        return replies.get(received.json["messages"][-1]["content"])

    return respond


def import_lines(sessions: int, turns: int) -> str:
    """JSON Lines of `sessions` x `turns` distinct turn records."""
    return "\n".join(json.dumps({
        "type": "turn", "session_id": f"import-{s}", "role": ("user", "assistant")[t % 2],
        "content": f"Imported note {s}-{t}: the {('blue', 'green', 'red')[t % 3]} service"
                   f" number {s * 1000 + t} runs on host h{t % 17}.",
    }) for s in range(sessions) for t in range(turns))


def db(process: Process) -> sqlite3.Connection:
    return closing(sqlite3.connect(process.data_dir / "memproxy.db"))  # type: ignore[return-value]


def query(process: Process, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    with db(process) as conn:
        return conn.execute(sql, params).fetchall()


def assert_consistent(process: Process) -> None:
    """Both SQLite files pass integrity_check; no turn is stored twice; every turn is indexed."""
    for path in (process.data_dir / "memproxy.db", *process.data_dir.rglob("chroma.sqlite3")):
        with closing(sqlite3.connect(path)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)], path
    twice = query(process, "SELECT user_id, session_id, parent_id, content_hash, count(*)"
                           " FROM turns GROUP BY 1, 2, 3, 4 HAVING count(*) > 1")
    assert twice == []
    unindexed = query(process, "SELECT id FROM turns WHERE id NOT IN (SELECT turn_id FROM chunks)")
    assert unindexed == []
    assert query(process, "SELECT status, count(*) FROM jobs GROUP BY status") == [
        ("done", query(process, "SELECT count(*) FROM jobs")[0][0])]
    stats = httpx.get(f"{process.url}/v1/memory/stats", timeout=30).json()
    chunks = query(process, "SELECT count(*) FROM chunks")[0][0]
    assert stats["index"]["vectors_total"] == chunks  # every chunk has its vector, once


def stop(process: Process, timeout: float = 30) -> float:
    """SIGTERM the process; return how long it took to exit (it must exit 0)."""
    sent = time.monotonic()
    process.popen.send_signal(signal.SIGTERM)
    code = process.popen.wait(timeout)
    assert code == 0, process.output()
    return time.monotonic() - sent


def test_kill_9_while_streaming_and_indexing_loses_and_duplicates_nothing(
    spawn: Callable[..., Process], upstream: ScriptedUpstream
) -> None:
    first = spawn()
    lines = import_lines(sessions=4, turns=25)
    imported = httpx.post(f"{first.url}/v1/memory/import", content=lines, timeout=60).json()
    assert imported["added"]["turns"] == 100
    question = "Please list the deploy steps for the billing service."
    upstream.respond_with(scripted_by_message({
        question: SSEReply(chat_chunks("Step one, step two, step three.", split=6), delay=2.0),
    }))
    streamed = stream_chat(first, question, "live")
    # Kill while an index job runs: the durable queue must hand it out again after restart.
    deadline = time.monotonic() + 30
    while not query(first, "SELECT 1 FROM jobs WHERE status = 'running'"):
        assert time.monotonic() < deadline, "no index job ever ran"
        time.sleep(0.005)
    first.popen.send_signal(signal.SIGKILL)
    assert first.popen.wait(10) == -signal.SIGKILL
    streamed.join(10)
    # Cut mid-body: no [DONE], the connection closed (or reset) under the client.
    assert isinstance(streamed.error, httpx.RemoteProtocolError | httpx.ReadError), streamed.error
    assert "data: [DONE]" not in streamed.lines
    left = dict(query(first, "SELECT status, count(*) FROM jobs GROUP BY status"))
    assert left.get("running", 0) + left.get("queued", 0) > 0, left  # killed mid-indexing
    asked = query(first, "SELECT count(*) FROM turns WHERE content = ?", (question,))
    assert asked == [(1,)]  # the accepted user turn was stored before the reply began

    second = spawn(first.data_dir)
    # The client retries what it never got to the end of; the import is retried too.
    upstream.respond_with(None)
    retried = httpx.post(f"{second.url}/v1/chat/completions", timeout=30, headers={
        "X-Memory-Session-Id": "live"}, json={
        "model": "gpt-4o", "messages": [{"role": "user", "content": question}]})
    assert retried.status_code == 200
    again = httpx.post(f"{second.url}/v1/memory/import", content=lines, timeout=60).json()
    assert again["added"]["turns"] == 0 and again["skipped"]["turns"] == 100
    wait_for_jobs(second.data_dir / "memproxy.db", later=True)
    assert query(second, "SELECT role, content, incomplete FROM turns WHERE session_id = 'live'"
                         " ORDER BY id") == [
        ("user", question, 0), ("assistant", f"echo: {question}", 0)]
    assert query(second, "SELECT count(*) FROM turns WHERE session_id LIKE 'import-%'") == [(100,)]
    assert_consistent(second)
    stop(second)


def test_sigterm_finishes_short_streams_cuts_long_ones_and_exits_0(
    spawn: Callable[..., Process], upstream: ScriptedUpstream
) -> None:
    # Under a second on purpose: uvicorn reads a grace of 0 as "wait forever".
    grace = 0.9
    server = spawn(shutdown_grace_seconds=str(grace))
    # Queued work at the moment of the signal: index jobs for 100 imported turns.
    lines = import_lines(sessions=4, turns=25)
    httpx.post(f"{server.url}/v1/memory/import", content=lines, timeout=60).raise_for_status()
    short_q, long_q = "Say something short.", "Tell me a very long story."
    short_text = "A short answer, soon done."
    long_text = " ".join(f"word{i}" for i in range(40))
    upstream.respond_with(scripted_by_message({
        short_q: SSEReply(chat_chunks(short_text, split=4), delay=0.05),
        long_q: SSEReply(chat_chunks(long_text, split=40), delay=0.5),  # 20 s: beyond the grace
    }))
    long = stream_chat(server, long_q, "long")
    short = stream_chat(server, short_q, "short")

    sent = time.monotonic()
    server.popen.send_signal(signal.SIGTERM)
    short.join(10)
    assert short.error is None and short.lines[-1] == "data: [DONE]"
    assert short.text() == short_text
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):  # no new connections once shutting down
        httpx.get(f"{server.url}/healthz", timeout=5)
    assert server.popen.wait(grace * 2 + 15) == 0, server.output()
    took = time.monotonic() - sent
    long.join(5)
    assert "data: [DONE]" not in long.lines  # cut at the grace period
    partial = long.text()
    assert partial and len(partial) < len(long_text) and long_text.startswith(partial)

    stored = query(server, "SELECT session_id, role, content, incomplete FROM turns"
                           " WHERE session_id IN ('short', 'long') ORDER BY session_id, id")
    assert stored == [
        ("long", "user", long_q, 0), ("long", "assistant", partial, 1),
        ("short", "user", short_q, 0), ("short", "assistant", short_text, 0),
    ]
    # Nothing was left "running"; every turn is indexed or waits in a queued index job.
    statuses = dict(query(server, "SELECT status, count(*) FROM jobs GROUP BY status"))
    assert set(statuses) <= {"done", "queued"}, statuses
    queued_turns = {turn for (payload,) in query(
        server, "SELECT payload FROM jobs WHERE status = 'queued' AND kind = 'index'")
        for turn in json.loads(payload)["turn_ids"]}
    unindexed = {turn for (turn,) in query(
        server, "SELECT id FROM turns WHERE id NOT IN (SELECT turn_id FROM chunks)")}
    assert unindexed <= queued_turns
    # Streams and running jobs share the grace (the process then needs a moment to exit).
    assert took < grace + 2, f"exit took {took:.1f}s with a {grace}s grace"
    print(f"\nSIGTERM to exit 0: {took:.2f}s (grace {grace}s, one stream cut,"
          f" {statuses.get('queued', 0)} jobs left queued)")


async def _leave_a_job_running(db_path: Path) -> None:
    """A database as a crash leaves it: one index job marked running."""
    store = await Storage.open(db_path)
    try:
        await store.log.append_turns("ada", "crashed", [NewTurn("user", "The kiln fires at 1240 C.")])
        assert len(await store.queue.claim(None, limit=1, now=time.time())) == 1
    finally:
        await store.close()


def test_the_engine_logs_through_memproxy_s_logger(
    spawn: Callable[..., Process], tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    asyncio.run(_leave_a_job_running(data_dir / "memproxy.db"))
    server = spawn(data_dir)
    wait_for_jobs(data_dir / "memproxy.db", later=True)
    stop(server)
    logged = [json.loads(line) for line in server.log.read_text().splitlines()
              if line.startswith("{")]
    requeued = [entry for entry in logged if entry["msg"].startswith("requeued 1 job(s)")]
    assert len(requeued) == 1, server.output()
    assert requeued[0]["level"] == "info" and requeued[0]["logger"].startswith("memproxy."), requeued
    assert all(entry["logger"].startswith("memproxy") for entry in logged), logged


def test_sigterm_drains_streams_and_jobs_together_within_the_grace(
    spawn: Callable[..., Process], upstream: ScriptedUpstream
) -> None:
    grace = 4.0
    server = spawn(shutdown_grace_seconds=str(grace), extract_every="1",
                   upstream_api_key="sk-operator")
    told, long_q = "I moved to Lisbon last spring.", "Tell me a very long story."
    long_text = " ".join(f"word{i}" for i in range(60))
    by_message = scripted_by_message({
        long_q: SSEReply(chat_chunks(long_text, split=60), delay=0.5),  # 30 s: beyond the grace
    })

    def respond(received: Received) -> Reply | None:
        messages = received.json.get("messages") if isinstance(received.json, dict) else None
        if messages and str(messages[0].get("content")).startswith(EXTRACT_SYSTEM[:30]):
            return JSONReply(chat_completion("[]"), delay=60)  # a job still running at the signal
        return by_message(received)

    upstream.respond_with(respond)
    told_reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "gpt-4o", "messages": [{"role": "user", "content": told}]})
    assert told_reply.status_code == 200
    deadline = time.monotonic() + 30
    while not query(server, "SELECT 1 FROM jobs WHERE kind = 'extract_facts' AND status = 'running'"):
        assert time.monotonic() < deadline, "the extraction job never ran"
        time.sleep(0.02)
    long = stream_chat(server, long_q, "long")

    signalled = time.time()
    took = stop(server, timeout=grace * 3 + 10)
    long.join(5)
    # Streams and jobs drained together: the app's shutdown ended inside the grace (the
    # process then needs a moment to exit; allowed for, as the machine may be loaded).
    logged = [json.loads(line) for line in server.log.read_text().splitlines()
              if line.startswith("{")]
    [worker_stopped] = [e["ts"] for e in logged if e["msg"].startswith("job worker stopped")]
    stopped = worker_stopped - signalled
    assert stopped < grace and took < grace + 1.0, (stopped, took)
    assert "data: [DONE]" not in long.lines
    partial = long.text()
    assert partial and long_text.startswith(partial) and len(partial) < len(long_text)
    assert query(server, "SELECT content, incomplete FROM turns WHERE session_id = 'long'"
                         " AND role = 'assistant'") == [(partial, 1)]
    # The running job was cut and put back in the queue for the next start; the cut reply's
    # own extraction job waits there too.
    assert query(server, "SELECT status, last_error FROM jobs WHERE kind = 'extract_facts'"
                         " ORDER BY id") == [
        ("queued", "interrupted: the worker stopped during this attempt"), ("queued", None)]
    print(f"\nSIGTERM with a stream and a job in flight: jobs stopped after {stopped:.2f}s,"
          f" exit after {took:.2f}s (grace {grace}s)")


def test_a_stream_cut_by_shutdown_ends_with_one_error_event(
    spawn: Callable[..., Process], upstream: ScriptedUpstream
) -> None:
    server = spawn(shutdown_grace_seconds="1.5")
    raw_q, sdk_q = "Tell me a very long story.", "Tell me another very long story."
    long_text = " ".join(f"word{i}" for i in range(40))
    upstream.respond_with(scripted_by_message({
        q: SSEReply(chat_chunks(long_text, split=40), delay=0.5) for q in (raw_q, sdk_q)
    }))
    raw = stream_chat(server, raw_q, "raw")
    sdk_error: list[BaseException] = []
    sdk_text: list[str] = []
    sdk_started = threading.Event()

    def sdk_stream() -> None:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)
        try:
            for chunk in client.chat.completions.create(
                model="gpt-4o", stream=True, messages=[{"role": "user", "content": sdk_q}]
            ):
                sdk_text.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
                sdk_started.set()
        except BaseException as exc:  # what the client sees: asserted below
            sdk_error.append(exc)
        finally:
            sdk_started.set()
            client.close()

    reader = threading.Thread(target=sdk_stream, daemon=True)
    reader.start()
    assert sdk_started.wait(30) and not sdk_error, sdk_error
    stop(server)
    raw.join(5)
    reader.join(5)

    # The raw stream: relayed chunks, then one error event in OpenAI's envelope, then the end.
    assert raw.error is None, raw.error
    errors = [i for i, line in enumerate(raw.lines) if line == "event: error"]
    assert errors == [len(raw.lines) - 2], raw.lines[-4:]
    error = json.loads(raw.lines[-1].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert "data: [DONE]" not in raw.lines and raw.text()
    # The official SDK turns it into an APIError carrying that message.
    assert len(sdk_error) == 1 and isinstance(sdk_error[0], openai.APIError), sdk_error
    assert "shutting down" in str(sdk_error[0]) and "".join(sdk_text)
