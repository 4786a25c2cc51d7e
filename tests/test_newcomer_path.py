"""A newcomer's first ten minutes, as the docs' "Try it without a model" page (docs/try-it.md) shows
them: the demo upstream and `memproxy serve` as processes, a first chat with each official
SDK, a fact learned and recalled, and what the model received.

The section's commands (marked `<!-- newcomer:... -->`) run in bash, as written, in a copy
of the repository after the README's install: its own `.venv`, a PATH without the tests'
interpreter, `../shared/models` beside it. Only the ports and the data directory change.
The copy's install is the README's `pip install -e .`, made quick: the copy's venv reaches
the packages this test run already has through a .pth file (no dependency is installed
again), and memproxy itself is installed from the copy (`--no-deps`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_DIR, ROOT, RunningProxy
from tests.support.servers import free_port

# Out of the fast lane (CONTRIBUTING.md, `process`): the demo upstream and memproxy as processes.
pytestmark = pytest.mark.process

SECTION = re.compile(r"<!-- docs:try-without-a-model -->(.*?)<!-- /docs:try-without-a-model -->", re.S)
BLOCK = re.compile(r"<!-- newcomer:(\w+) -->\n```(\w+)\n(.*?)```(?:\n+(?:[^`<]*\n)*?```text\n(.*?)```)?", re.S)


def blocks() -> list[tuple[str, str, str | None]]:
    """(mark, code, the expected output shown after it) of each marked block, in order."""
    section = SECTION.search((ROOT / "docs" / "try-it.md").read_text())
    assert section is not None, "docs/try-it.md lost its 'Try it without a model' section"
    found = [(m[1], m[3], m[4]) for m in BLOCK.finditer(section[1])]
    assert [mark for mark, _, _ in found] == ["sh", "upstream", "serve", "sh", "sh", "sh"]
    return found


class Ports:
    def __init__(self, data_dir: Path) -> None:
        self.upstream, self.proxy, self.data_dir = free_port(), free_port(), data_dir

    def apply(self, text: str) -> str:
        """The command with this test's ports and data directory."""
        for old, new in (("127.0.0.1:8001", f"127.0.0.1:{self.upstream}"),
                         ("127.0.0.1:8080", f"127.0.0.1:{self.proxy}"),
                         ("--port 8001", f"--port {self.upstream}"),
                         ("--port 8080", f"--port {self.proxy}"),
                         ("/tmp/memproxy-demo", str(self.data_dir))):
            text = text.replace(old, new)
        return text


def environment() -> dict[str, str]:
    """This environment as a new shell has it: no MEMPROXY_* variables, no virtualenv, and
    no directory of the tests' interpreter on PATH (`python`, `memproxy` are not found there)."""
    ours = Path(sys.prefix).resolve()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MEMPROXY_") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    path = [d for d in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
            if d and not Path(d).resolve().is_relative_to(ours)]
    # litellm reads its price map offline with this (docs/dependencies.md), as on this machine.
    return {**env, "PATH": os.pathsep.join(path), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "NO_PROXY": "127.0.0.1"}


def fresh_clone(root: Path) -> Path:
    """The checkout's files (tracked and new, not ignored) at `root`/memproxy, the models at
    `root`/shared/models, and the README's `python3 -m venv .venv && .venv/bin/pip install
    -e .` done without a download."""
    repo = root / "memproxy"
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_bytes(source.read_bytes())
    (root / "shared").mkdir()
    (root / "shared" / "models").symlink_to(MODEL_DIR.parent)
    # The README's `python3`, as the Python these tests run on (the .pth below shares its
    # packages, which must be of the same version).
    python3 = Path(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    subprocess.run([python3, "-m", "venv", "--without-pip", ".venv"], cwd=repo, check=True,
                   env=environment(), timeout=120)
    venv_python = repo / ".venv" / "bin" / "python"
    own = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # After the venv's own site-packages: memproxy installed below wins over the tests' copy.
    Path(own, "zz_test_packages.pth").write_text("\n".join(sorted(shared)) + "\n")
    # The build backend comes from pip's configured index, as the README's install gets it.
    subprocess.run([venv_python, "-m", "pip", "install", "-q", "--no-deps", "-e", "."],
                   cwd=repo, env=environment(), check=True, capture_output=True, timeout=300)
    return repo


def shell(code: str, repo: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`code` run by bash in the repository, as a reader pastes it into a terminal."""
    return subprocess.run(["bash", "-c", code], cwd=repo, env=environment(),
                          capture_output=True, text=True, timeout=timeout)


def start(code: str, repo: Path, log: Path) -> subprocess.Popen[bytes]:
    """`code` run by bash in the background, in a process group of its own (stopped whole)."""
    with log.open("wb") as out:
        return subprocess.Popen(["bash", "-c", code], cwd=repo, env=environment(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


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
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass  # the group has gone already (a command that failed)


def test_the_newcomer_path_runs_as_written(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    (_, install, _), (_, upstream_cmd, _), (_, serve_cmd, _), *snippets, (_, captured_cmd, _) = blocks()
    repo = fresh_clone(tmp_path)
    ports = Ports(tmp_path / "data")
    installed = shell(install, repo, timeout=300)
    assert installed.returncode == 0, installed.stderr

    processes.append(start(ports.apply(upstream_cmd), repo, tmp_path / "upstream.log"))
    wait_until(f"http://127.0.0.1:{ports.upstream}/control/captured", processes[0],
               tmp_path / "upstream.log")
    processes.append(start(ports.apply(serve_cmd), repo, tmp_path / "serve.log"))
    wait_until(f"http://127.0.0.1:{ports.proxy}/readyz", processes[1], tmp_path / "serve.log")
    ready = httpx.get(f"http://127.0.0.1:{ports.proxy}/readyz").json()
    assert ready["status"] == "ok" and ready["parts"]["learning"] == "ok", ready
    # The server is the copy's, not this checkout's.
    assert _runs_from(processes[1], repo)

    for _, code, expected in snippets:
        ran = shell(ports.apply(code), repo)
        assert ran.returncode == 0, ran.stderr
        assert expected is not None and ran.stdout == expected, (ran.stdout, ran.stderr)

    shown = shell(ports.apply(captured_cmd), repo, timeout=60)
    assert "<memory>" in shown.stdout and "You extract durable facts" in shown.stdout, shown
    # Learning went through both routes: chat completions and Messages.
    captured = httpx.get(f"http://127.0.0.1:{ports.upstream}/control/captured").json()["data"]
    learning = {r["path"] for r in captured if "You extract durable facts" in str(r["body"])}
    assert learning == {"/v1/chat/completions", "/v1/messages"}, learning
    assert all(r["headers"].get("x-api-key", "demo-k...") == "demo-k..." for r in captured)


def _runs_from(process: subprocess.Popen[bytes], repo: Path) -> bool:
    """Whether the process (or the one bash started for it) runs the copy's interpreter."""
    found = subprocess.run(["pgrep", "-s", str(process.pid), "-a"], capture_output=True, text=True)
    return str(repo / ".venv") in found.stdout


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
    """docs/memory-api.md's curl block, run as written in one shell (issue 39: its user and
    its fact id are its own, not try-it's, and the pinned fact it adds shows in its search)."""
    section = re.search(r"<!-- docs:memory-api-bodies -->.*?```sh\n(.*?)```",
                        (ROOT / "docs" / "memory-api.md").read_text(), re.S)
    assert section is not None
    script = section[1]
    assert "/facts/1 " not in script and "ada" not in script  # try-it's user and fact ids
    proxy = start_proxy(memory=True)
    (tmp_path / "memory.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "I like tea."}]}\n')
    ran = subprocess.run(["bash", "-c", "set -eo pipefail\n"
                          + script.replace("http://127.0.0.1:8080", proxy.url)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    answers, at, decoder = [], 0, json.JSONDecoder()
    while at < len(ran.stdout):
        answer, at = decoder.raw_decode(ran.stdout, at)
        answers.append(answer)
    assert [a.get("object") for a in answers] == [
        "memory.fact", "memory.search", "memory.profile", "memory.profile",
        "memory.clear.undo", "memory.import"], answers
    assert not [a for a in answers if "error" in a], answers
    shown = [item["text"] for item in answers[1]["items"]]
    assert "Prefers TypeScript with strict mode" in shown, answers[1]
    assert answers[4]["restored"] is True


def test_the_readme_says_how_to_install_each_sdk_its_examples_import() -> None:
    """The README's examples import SDKs memproxy does not depend on; it says to install them."""
    readme = (ROOT / "README.md").read_text()
    imported = {m[1] for m in re.finditer(r"^(?:from|import) (\w+)", readme, re.M)}
    needs = imported & {"openai", "anthropic"}
    installs = " ".join(re.findall(r"pip install ([\w .-]+)", readme))
    assert needs and needs <= set(installs.split()), (needs, installs)
