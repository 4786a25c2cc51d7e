"""A newcomer's first ten minutes, as the docs' "Try it without a model" page (docs/try-it.md) shows
them: the demo upstream and `memproxy serve` as processes, a first chat with each official
SDK, a fact learned and recalled, and what the model received. The commands are the
section's own (marked `<!-- newcomer:... -->`), run as written but on free ports."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_DIR, ROOT, RunningProxy
from tests.support.servers import free_port

# Out of the fast lane (CONTRIBUTING.md): the demo upstream and memproxy as processes.
pytestmark = pytest.mark.slow

SECTION = re.compile(r"<!-- docs:try-without-a-model -->(.*?)<!-- /docs:try-without-a-model -->", re.S)
BLOCK = re.compile(r"<!-- newcomer:(\w+) -->\n```(\w+)\n(.*?)```(?:\n+(?:[^`<]*\n)*?```text\n(.*?)```)?", re.S)


def blocks() -> list[tuple[str, str, str | None]]:
    """(mark, code, the expected output shown after it) of each marked block, in order."""
    section = SECTION.search((ROOT / "docs" / "try-it.md").read_text())
    assert section is not None, "docs/try-it.md lost its 'Try it without a model' section"
    found = [(m[1], m[3], m[4]) for m in BLOCK.finditer(section[1])]
    assert [mark for mark, _, _ in found] == ["upstream", "serve", "python", "python", "sh"]
    return found


class Ports:
    def __init__(self, data_dir: Path) -> None:
        self.upstream, self.proxy, self.data_dir = free_port(), free_port(), data_dir

    def apply(self, text: str) -> str:
        """The command with this test's ports, data directory, model and interpreter."""
        for old, new in (("127.0.0.1:8001", f"127.0.0.1:{self.upstream}"),
                         ("127.0.0.1:8080", f"127.0.0.1:{self.proxy}"),
                         ("--port 8001", f"--port {self.upstream}"),
                         ("--port 8080", f"--port {self.proxy}"),
                         ("/tmp/memproxy-demo", str(self.data_dir)),
                         ("../shared/models/all-MiniLM-L6-v2", str(MODEL_DIR))):
            text = text.replace(old, new)
        return text


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}
    return {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_PROXY": "127.0.0.1"}


def start(command: str, log: Path) -> subprocess.Popen[bytes]:
    """`VAR=value ... program args` as a process; `python`/`memproxy` are this checkout's."""
    words = shlex.split(command)
    env = environment()
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    program = {"python": [sys.executable], "memproxy": [sys.executable, "-m", "proxy"]}[words[0]]
    with log.open("wb") as out:
        return subprocess.Popen([*program, *words[1:]], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def wait_until(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{process.args!r} exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=5).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{url} did not answer:\n{log.read_text()[-3000:]}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in reversed(started):
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_newcomer_path_runs_as_written(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    (_, upstream_cmd, _), (_, serve_cmd, _), *snippets, (_, captured_cmd, _) = blocks()
    ports = Ports(tmp_path / "data")
    processes.append(start(ports.apply(upstream_cmd.strip()), tmp_path / "upstream.log"))
    wait_until(f"http://127.0.0.1:{ports.upstream}/control/captured", processes[0],
               tmp_path / "upstream.log")
    processes.append(start(ports.apply(serve_cmd.strip()), tmp_path / "serve.log"))
    wait_until(f"http://127.0.0.1:{ports.proxy}/readyz", processes[1], tmp_path / "serve.log")
    ready = httpx.get(f"http://127.0.0.1:{ports.proxy}/readyz").json()
    assert ready["status"] == "ok" and ready["parts"]["learning"] == "ok", ready

    for _, code, expected in snippets:
        ran = subprocess.run([sys.executable, "-c", ports.apply(code)], cwd=tmp_path,
                             env=environment(), capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        assert expected is not None and ran.stdout == expected, (ran.stdout, ran.stderr)

    shown = subprocess.run(["bash", "-c", ports.apply(captured_cmd).replace(
        "python -m", f"{sys.executable} -m")], capture_output=True, text=True, timeout=60)
    assert "<memory>" in shown.stdout and "You extract durable facts" in shown.stdout, shown
    # Learning went through both routes: chat completions and Messages.
    captured = httpx.get(f"http://127.0.0.1:{ports.upstream}/control/captured").json()["data"]
    learning = {r["path"] for r in captured if "You extract durable facts" in str(r["body"])}
    assert learning == {"/v1/chat/completions", "/v1/messages"}, learning
    assert all(r["headers"].get("x-api-key", "demo-k...") == "demo-k..." for r in captured)


def test_the_demo_model_answers_learning_prompts_and_captured_is_bounded() -> None:
    from tests.support.demo_model import DemoModel
    from tests.support.scripted_upstream import CAPTURED_MAX, ScriptedUpstream

    with ScriptedUpstream() as up:
        up.respond_with(DemoModel())
        transcript = ("Known facts about the user: none\n\nConversation:\n"
                      "[1] 2026-05-08 user: I live in Oslo.\n[2] 2026-05-08 assistant: Nice.\n"
                      "[3] NEW 2026-05-08 user (Ada): I work on the billing service. I love jazz.")
        asked = {"model": "m", "messages": [
            {"role": "system", "content": "You extract durable facts about the USER ..."},
            {"role": "user", "content": transcript}]}
        for _ in range(CAPTURED_MAX + 5):
            answer = httpx.post(f"{up.base_url}/chat/completions", json=asked,
                                headers={"authorization": "Bearer sk-secret-key"}).json()
        facts = json.loads(answer["choices"][0]["message"]["content"])
        assert [(f["fact"], f["category"], f["turns"]) for f in facts] == [
            ("User loves jazz.", "preference", [3]),
            ("User works on the billing service.", "project", [3]),
        ]
        message = httpx.post(f"{up.base_url}/messages", json={
            "model": "claude", "max_tokens": 50,
            "system": "You summarise a conversation between a user and an assistant ...",
            "messages": [{"role": "user", "content": transcript}]}).json()
        summary = json.loads(message["content"][0]["text"])
        assert summary["text"].startswith("The user said: I live in Oslo.")
        captured = httpx.get(f"http://127.0.0.1:{up.port}/control/captured").json()["data"]
        assert len(captured) == CAPTURED_MAX and captured[-1]["path"] == "/v1/messages"
        assert captured[0]["headers"]["authorization"] == "Bearer..."
        assert "sk-secret-key" not in str(captured)


def test_the_memory_api_body_examples_run(
    start_proxy: Callable[..., RunningProxy], tmp_path: Path
) -> None:
    section = re.search(r"<!-- docs:memory-api-bodies -->.*?```sh\n(.*?)```",
                        (ROOT / "docs" / "memory-api.md").read_text(), re.S)
    assert section is not None
    setup, *calls = [line for line in section[1].splitlines() if line.strip()]
    proxy = start_proxy(memory=True)
    setup = setup.replace("http://127.0.0.1:8080", proxy.url)
    (tmp_path / "memory.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "I like tea."}]}\n')
    token = ""
    for call in calls:
        ran = subprocess.run(["bash", "-c", f"{setup}\n{call.replace('...', token)}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
        answer = json.loads(ran.stdout)
        assert "error" not in answer, (call, answer)
        token = answer.get("undo_token", token)
    assert token, "the clear answered no undo token"
