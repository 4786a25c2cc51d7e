"""The memory CLI against a running memproxy: every command, as a table and as --json."""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.cli.client import MemoryClient
from proxy.cli.main import main
from tests.conftest import ROOT, RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import QUIET, Starter, memory_api

pytestmark = pytest.mark.both_backends


@pytest.fixture
def memproxy(start_proxy: Starter) -> RunningProxy:
    return start_proxy(memory=True, **QUIET)


def run(capsys: pytest.CaptureFixture[str], proxy: RunningProxy, *argv: str) -> tuple[int, str, str]:
    """`memproxy ARGV --url ...` in-process: exit status, stdout, stderr."""
    status = main([*argv, "--url", proxy.url])
    out, err = capsys.readouterr()
    return status, out, err


def run_json(capsys: pytest.CaptureFixture[str], proxy: RunningProxy, *argv: str) -> Any:
    status, out, err = run(capsys, proxy, *argv, "--json")
    assert status == 0, err
    return json.loads(out)


def test_memories_commands(capsys: pytest.CaptureFixture[str], memproxy: RunningProxy) -> None:
    status, out, _ = run(capsys, memproxy, "memories", "add", "Prefers tabs over spaces",
                         "--category", "preference")
    assert status == 0 and out.startswith("Added fact 1 (preference): Prefers tabs over spaces")
    added = run_json(capsys, memproxy, "memories", "add", "Works on the billing service",
                     "--category", "project", "--importance", "8", "--pin")
    assert added["pinned"] is True and added["importance"] == 8 and added["confidence"] == 0.6

    status, out, _ = run(capsys, memproxy, "memories", "list")
    header, rule, *rows = out.splitlines()
    assert header.split() == ["ID", "CATEGORY", "CONF", "PIN", "TEXT"] and set(rule) <= {"-", " "}
    assert rows[0].split()[:4] == [str(added["id"]), "project", "0.60", "*"]
    assert rows[1].endswith("Prefers tabs over spaces")
    listed = run_json(capsys, memproxy, "memories", "list", "--category", "preference")
    assert [f["text"] for f in listed] == ["Prefers tabs over spaces"]
    assert [f["id"] for f in run_json(capsys, memproxy, "memories", "list", "--pinned")] == [added["id"]]
    assert len(run_json(capsys, memproxy, "memories", "list", "--limit", "1")) == 1
    assert run_json(capsys, memproxy, "memories", "list", "-q", "billing")[0]["id"] == added["id"]

    status, out, _ = run(capsys, memproxy, "memories", "edit", "1", "--text", "Prefers spaces")
    assert status == 0 and "Fact 1 is now fact 3 (version 2): Prefers spaces" in out
    edited = run_json(capsys, memproxy, "memories", "edit", "3", "--confidence", "0.9")
    assert (edited["version"], edited["confidence"]) == (3, 0.9)
    history = run_json(capsys, memproxy, "memories", "list", "--all")
    assert {f["text"] for f in history if not f["active"]} == {"Prefers tabs over spaces", "Prefers spaces"}

    status, out, _ = run(capsys, memproxy, "memories", "pin", str(edited["id"]))
    assert status == 0 and out.startswith(f"Pinned fact {edited['id']}")
    assert run_json(capsys, memproxy, "memories", "pin", str(edited["id"]), "--off")["pinned"] is False

    chat(memproxy, "The release train leaves every second Tuesday.", session="rel")
    wait_for_jobs(memproxy)
    status, out, _ = run(capsys, memproxy, "memories", "search", "when does the release train leave?")
    assert status == 0 and "second Tuesday" in out and "tokens" in out.splitlines()[-1]
    # The first column is each item's place in the block (not a rank by score), and says so.
    header, _, *rows, summary = out.splitlines()
    assert header.split()[:4] == ["IN", "BLOCK", "SOURCE", "SCORE"]
    assert [row.split()[0] for row in rows] == [str(i) for i in range(1, len(rows) + 1)]
    assert summary.startswith(f"{len(rows)} {'item' if len(rows) == 1 else 'items'} in block order, ")
    found = run_json(capsys, memproxy, "memories", "search", "release train", "--budget", "200")
    assert found["budget"] == 200 and found["items"][0]["session_id"] == "rel"
    status, out, _ = run(capsys, memproxy, "memories", "search", "release train", "--budget", "0")
    assert status == 0 and out.startswith("Nothing would be injected")

    status, out, _ = run(capsys, memproxy, "memories", "forget", str(edited["id"]))
    forgot, _, undo = out.strip().partition("\n")
    assert status == 0 and forgot == f"Forgot fact {edited['id']} and its history."
    window, _, undo = undo.partition(": ")
    assert re.fullmatch(r"Undo within (59|60) s", window), window
    assert undo.startswith(f"memproxy memories undo --url {memproxy.url} --token=")
    assert run_json(capsys, memproxy, "memories", "forget", str(added["id"]))["deleted"] is True
    status, out, _ = run(capsys, memproxy, "memories", "list")
    assert out.strip() == "No facts."
    status, out, _ = run(capsys, memproxy, *shlex.split(undo)[1:])
    assert status == 0 and out.strip() == f"Restored {edited['version']} facts."  # the history
    assert [f["text"] for f in run_json(capsys, memproxy, "memories", "list")] == [edited["text"]]

    status, _, err = run(capsys, memproxy, "memories", "forget", "999")
    assert status == 1 and err.startswith("memproxy: no fact 999 (404 not_found)")
    status, _, err = run(capsys, memproxy, "memories", "edit", "5")
    assert status == 1 and "nothing to change" in err
    status, _, err = run(capsys, memproxy, "memories", "add", "x", "--confidence", "7")
    assert status == 1 and "confidence" in err


def test_a_listing_is_followed_across_its_pages(
    capsys: pytest.CaptureFixture[str], memproxy: RunningProxy
) -> None:
    for i in range(5):
        assert run(capsys, memproxy, "memories", "add", f"Fact number {i}", "--category",
                   "context")[0] == 0
    client = MemoryClient(argparse.Namespace(url=memproxy.url, key=None, user=None, org=None))
    with client.http:
        every = client.pages("/facts", {"limit": 2})  # three pages: 2, 2 and 1
        assert sorted(f["text"] for f in every) == [f"Fact number {i}" for i in range(5)]
        assert client.pages("/facts", {"limit": 2}, 3) == every[:3]


def test_sessions_and_stats(capsys: pytest.CaptureFixture[str], memproxy: RunningProxy) -> None:
    chat(memproxy, "Our on-call rotation changes on Mondays.", session="oncall")
    chat(memproxy, "Grafana lives at grafana.internal.", session="dash")
    wait_for_jobs(memproxy)
    status, out, _ = run(capsys, memproxy, "sessions", "list")
    header, _, *rows = out.splitlines()
    assert header.split()[:2] == ["SESSION", "LAST"] and [r.split()[0] for r in rows] == ["dash", "oncall"]
    listed = run_json(capsys, memproxy, "sessions", "list", "--limit", "1")
    assert [s["session_id"] for s in listed] == ["dash"]

    status, out, _ = run(capsys, memproxy, "sessions", "show", "oncall")
    lines = out.splitlines()
    assert lines[0].startswith("Session oncall: 2 turns")
    assert lines[2].endswith("user: Our on-call rotation changes on Mondays.")
    assert lines[3].endswith("assistant: echo: Our on-call rotation changes on Mondays.")
    shown = run_json(capsys, memproxy, "sessions", "show", "oncall")
    assert [t["role"] for t in shown["turns_list"]] == ["user", "assistant"]

    status, out, _ = run(capsys, memproxy, "stats")
    assert status == 0 and out.startswith("Memory of default")
    assert any(line.split() == ["turns", "4"] for line in out.splitlines())
    stats = run_json(capsys, memproxy, "stats")
    assert stats["counts"]["sessions"] == 2 and stats["jobs"]["depth"] == 0

    status, out, _ = run(capsys, memproxy, "sessions", "delete", "oncall")
    assert status == 0 and out.startswith("Deleted session oncall: 2 turns")
    assert run_json(capsys, memproxy, "sessions", "delete", "dash")["removed"]["turns"] == 2
    status, out, _ = run(capsys, memproxy, "sessions", "list")
    assert out.strip() == "No sessions."
    status, _, err = run(capsys, memproxy, "sessions", "show", "oncall")
    assert status == 1 and "no session 'oncall'" in err


def test_export_and_import_with_both_outputs(
    capsys: pytest.CaptureFixture[str], memproxy: RunningProxy, start_proxy: Starter, tmp_path: Path,
    new_database_url: Callable[[], str | None],
) -> None:
    chat(memproxy, "The office moved to Canal Street.", session="office")
    run(capsys, memproxy, "memories", "add", "Cycles to work", "--category", "context")
    wait_for_jobs(memproxy)
    dump = tmp_path / "memory.jsonl"
    status, out, err = run(capsys, memproxy, "memories", "export", "-o", str(dump))
    assert status == 0 and out == "" and err.strip() == f"Exported 2 turns, 1 fact to {dump}."
    assert "\r" not in err  # no progress bar when stderr is not a terminal
    summary = run_json(capsys, memproxy, "memories", "export", "-o", str(tmp_path / "again.jsonl"))
    assert summary == {"file": str(tmp_path / "again.jsonl"), "records": {"turn": 2, "fact": 1}}
    status, out, _ = run(capsys, memproxy, "memories", "export")
    assert status == 0 and out.splitlines()[1:] == dump.read_text().splitlines()[1:]

    target = start_proxy(memory=True, data_dir=tmp_path / "fresh", database_url=new_database_url(),
                         **QUIET)
    status, out, _ = run(capsys, target, "memories", "import", str(dump))
    assert status == 0 and out.strip() == "Imported 2 turns, 1 fact; already there: nothing."
    again = run_json(capsys, target, "memories", "import", str(dump))
    assert again["added"] == {"turns": 0, "facts": 0, "summaries": 0, "profile": 0}
    status, _, err = run(capsys, target, "memories", "import", str(tmp_path / "missing.jsonl"))
    assert status == 1 and "missing.jsonl" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "fact", "text": "x", "category": "mood"}\n')
    status, _, err = run(capsys, target, "memories", "import", str(bad))
    assert status == 1 and "line 1: category must be one of" in err


def test_clear_needs_yes_and_undo_brings_it_back(
    capsys: pytest.CaptureFixture[str], memproxy: RunningProxy
) -> None:
    run(capsys, memproxy, "memories", "add", "Keeps bees", "--category", "context")
    chat(memproxy, "The hive is behind the shed.", session="bees")
    wait_for_jobs(memproxy)
    status, out, err = run(capsys, memproxy, "memories", "clear")
    assert (status, out) == (2, "") and "add --yes" in err
    assert run_json(capsys, memproxy, "stats")["counts"]["facts"] == 1  # nothing happened

    status, out, _ = run(capsys, memproxy, "memories", "clear", "--yes")
    assert status == 0
    done, hint = out.strip().rsplit(" ", 1)
    assert done == f"Cleared 2 turns, 1 fact. Undo within 60 s: memproxy memories undo --url {memproxy.url}"
    assert hint.startswith("--token=")
    assert run(capsys, memproxy, "memories", "list")[1].strip() == "No facts."
    status, out, _ = run(capsys, memproxy, "memories", "undo", hint)
    assert status == 0 and out.strip() == "Restored 2 turns, 1 fact."
    assert [f["text"] for f in run_json(capsys, memproxy, "memories", "list")] == ["Keeps bees"]

    receipt = run_json(capsys, memproxy, "memories", "clear", "--yes")
    assert receipt["object"] == "memory.clear" and receipt["removed"]["facts"] == 1
    restored = run_json(capsys, memproxy, "memories", "undo", f"--token={receipt['undo_token']}")
    assert restored["restored"] is True and restored["added"]["facts"] == 1
    status, _, err = run(capsys, memproxy, "memories", "undo", "--token=-not-a-token")
    assert status == 1 and "(404" in err


def as_printed(capsys: pytest.CaptureFixture[str], command: str) -> tuple[int, str, str]:
    """The printed `memproxy ...` command line, run in-process exactly as printed."""
    words = shlex.split(command)
    assert words[0] == "memproxy", command
    status = main(words[1:])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_printed_undo_names_the_user_and_the_window(
    capsys: pytest.CaptureFixture[str], memproxy: RunningProxy
) -> None:
    """Issue 39 item 4: with --user, the undo command that forget and clear print must name
    the user too (the token is the user's: without it, 404), and say how long it works."""
    bo = ("--user", "bo the gardener")
    run(capsys, memproxy, "memories", "add", "Grows tomatoes", *bo)
    fact = run_json(capsys, memproxy, "memories", "add", "Keeps a sourdough starter", *bo)
    status, out, _ = run(capsys, memproxy, "memories", "forget", str(fact["id"]), *bo)
    window, _, command = out.strip().splitlines()[-1].partition(": ")
    assert status == 0 and re.fullmatch(r"Undo within (59|60) s", window), out
    status, out, err = as_printed(capsys, command)
    assert (status, out.strip()) == (0, "Restored 1 fact."), err

    status, out, _ = run(capsys, memproxy, "memories", "clear", "--yes", *bo)
    assert status == 0 and out.startswith("Cleared 2 facts. Undo within 60 s: memproxy"), out
    status, out, err = as_printed(capsys, out.strip().partition(" s: ")[2])
    assert (status, out.strip()) == (0, "Restored 2 facts."), err
    texts = {f["text"] for f in run_json(capsys, memproxy, "memories", "list", *bo)}
    assert texts == {"Grows tomatoes", "Keeps a sourdough starter"}

    # A key given on the command line is not printed back; the hint says to give it again.
    status, out, _ = run(capsys, memproxy, "memories", "clear", "--yes", "--key", "sk-any", *bo)
    assert "Undo within 60 s with the same --key: " in out and "sk-any" not in out


def _cli(proxy: RunningProxy, *argv: str) -> list[str]:
    # `-m proxy` from the repository: this checkout's code, as the console script runs it.
    return [sys.executable, "-m", "proxy", *argv, "--url", proxy.url]


@pytest.mark.process
def test_a_closed_output_pipe_ends_quietly(memproxy: RunningProxy) -> None:
    # The reader is gone before memproxy writes a byte.
    process = subprocess.Popen(_cli(memproxy, "stats"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=ROOT)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    err = process.stderr.read()
    process.stderr.close()
    assert (process.wait(timeout=60), err) == (141, b"")

    # `| head -1` on an export larger than a pipe holds: head leaves after one line.
    records = [{"type": "turn", "session_id": "big", "role": "user", "content": f"{i} " + "x" * 500}
               for i in range(300)]
    body = "".join(json.dumps(r) + "\n" for r in records)
    with memory_api(memproxy) as api:
        assert api.post("/import", content=body).status_code == 200
    command = shlex.join(_cli(memproxy, "memories", "export")) + " | head -1"
    piped = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert piped.stderr == "" and piped.returncode == 141
    assert json.loads(piped.stdout)["type"] == "meta"
    wait_for_jobs(memproxy)


@pytest.mark.process
def test_console_script_with_keys_env_and_a_progress_bar(start_proxy: Starter, tmp_path: Path) -> None:
    proxy = start_proxy(memory=True, api_keys="key-cli-000001:carol", **QUIET)
    records = [{"type": "turn", "session_id": f"s{i // 100}", "role": "user",
                "content": f"message {i}"} for i in range(400)]
    source = tmp_path / "big.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {**os.environ, "MEMPROXY_URL": proxy.url, "MEMPROXY_KEY": "key-cli-000001"}
    script = str(Path(sys.executable).with_name("memproxy"))

    denied = subprocess.run([script, "stats"], capture_output=True, text=True, timeout=60,
                            env={**env, "MEMPROXY_KEY": "wrong-key-000"}, cwd=ROOT)
    assert denied.returncode == 1 and "(401 invalid_api_key)" in denied.stderr

    # On a terminal the import shows a progress bar on stderr; stdout stays clean.
    main_fd, child_fd = pty.openpty()
    imported = subprocess.run([script, "memories", "import", str(source)], stdout=subprocess.PIPE,
                              stderr=child_fd, env=env, timeout=120, cwd=ROOT)
    os.close(child_fd)
    terminal = _drain(main_fd)
    assert imported.returncode == 0, terminal
    assert imported.stdout.decode().strip() == "Imported 400 turns; already there: nothing."
    assert "uploading [" in terminal and "100%" in terminal

    main_fd, child_fd = pty.openpty()
    exported = subprocess.run([script, "memories", "export", "-o", str(tmp_path / "out.jsonl")],
                              stdout=subprocess.PIPE, stderr=child_fd, env=env, timeout=120, cwd=ROOT)
    os.close(child_fd)
    terminal = _drain(main_fd)
    assert exported.returncode == 0
    assert "exporting [" in terminal and "401/401" in terminal
    assert f"Exported 400 turns to {tmp_path / 'out.jsonl'}" in terminal

    stats = subprocess.run([script, "stats", "--json"], capture_output=True, text=True, timeout=60,
                           env=env, cwd=ROOT)
    assert json.loads(stats.stdout)["user_id"] == "carol"  # the key's user
    wait_for_jobs(proxy)


def _drain(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def test_the_docs_cli_example_runs_as_shown(
    capsys: pytest.CaptureFixture[str], memproxy: RunningProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page = (ROOT / "docs" / "memory-api.md").read_text()
    block = page.split("```console\n$ memproxy memories add", 1)[1].split("```", 1)[0]
    lines = ("$ memproxy memories add" + block).splitlines()
    monkeypatch.chdir(tmp_path)
    commands: list[tuple[list[str], list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            commands.append((shlex.split(line[2:])[1:], []))
        else:
            commands[-1][1].append(line)
    assert len(commands) == 9
    monkeypatch.setenv("MEMPROXY_URL", memproxy.url)  # the page's commands name no --url
    for argv, expected in commands:
        status = main(argv)
        out, err = capsys.readouterr()
        assert status == 0, err
        # An undo token is new each time: the page shows it as `...`.
        shown = [re.sub(r"--token=\S+", "--token=...", line) for line in (out + err).splitlines()]
        assert shown == expected, argv


def test_a_newer_export_updates_what_an_older_one_imported(
    capsys: pytest.CaptureFixture[str], memproxy: RunningProxy, tmp_path: Path
) -> None:
    """Issue 39 item 5: after an edit and an unpin, importing the newer export into the user
    the older one went to brings the new version and the unpin, and says so by count."""
    ann, ben = ("--user", "ann"), ("--user", "ben")
    tea = run_json(capsys, memproxy, "memories", "add", "Drinks oolong", "--pin", *ann)
    run_json(capsys, memproxy, "memories", "add", "Walks to work", *ann)
    older, newer = tmp_path / "older.jsonl", tmp_path / "newer.jsonl"
    assert run(capsys, memproxy, "memories", "export", "-o", str(older), *ann)[0] == 0
    status, out, _ = run(capsys, memproxy, "memories", "import", str(older), *ben)
    assert (status, out.strip()) == (0, "Imported 2 facts; already there: nothing.")

    edited = run_json(capsys, memproxy, "memories", "edit", str(tea["id"]), "--text",
                      "Drinks sencha", *ann)
    run_json(capsys, memproxy, "memories", "pin", str(edited["id"]), "--off", *ann)
    assert run(capsys, memproxy, "memories", "export", "-o", str(newer), *ann)[0] == 0
    status, out, _ = run(capsys, memproxy, "memories", "import", str(newer), *ben)
    assert (status, out.strip()) == (0, "Imported 1 fact; updated to the file's newer version:"
                                        " 1 fact; already there: 1 fact.")
    facts = run_json(capsys, memproxy, "memories", "list", *ben)
    assert sorted((f["text"], f["pinned"]) for f in facts) == [
        ("Drinks sencha", False), ("Walks to work", False)]
    history = run_json(capsys, memproxy, "memories", "list", "--all", *ben)
    assert sorted(f["text"] for f in history if not f["active"]) == ["Drinks oolong"]

    # Again, or the older file once more: nothing changes, and the count says why.
    for again, kept in ((newer, 3), (older, 2)):
        status, out, _ = run(capsys, memproxy, "memories", "import", str(again), *ben)
        assert (status, out.strip()) == (0, f"Imported nothing; already there: {kept} facts.")
    assert run_json(capsys, memproxy, "memories", "list", *ben) == facts

    # Only the pin changed since the last import: the stored version takes it.
    current = next(f for f in run_json(capsys, memproxy, "memories", "list", *ann)
                   if f["text"] == "Drinks sencha")
    run_json(capsys, memproxy, "memories", "pin", str(current["id"]), *ann)
    assert run(capsys, memproxy, "memories", "export", "-o", str(newer), *ann)[0] == 0
    status, out, _ = run(capsys, memproxy, "memories", "import", str(newer), *ben)
    assert (status, out.strip()) == (0, "Imported nothing; updated to the file's newer version:"
                                        " 1 fact; already there: 2 facts.")
    pinned = run_json(capsys, memproxy, "memories", "list", "--pinned", *ben)
    assert [f["text"] for f in pinned] == ["Drinks sencha"]
