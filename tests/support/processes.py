"""memproxy as a real process (`python -m proxy serve`) on a free loopback port, for the tests
that kill or signal it (tests/test_process.py, tests/test_replicas.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_DIR, ROOT
from tests.support.servers import free_port

START_TIMEOUT = 120.0  # a cold start imports chromadb and onnxruntime: slow on a loaded machine


@dataclass
class Process:
    """A memproxy server process and where it keeps its data."""

    popen: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def memproxy_env(upstream_base_url: str, **settings: str) -> dict[str, str]:
    """This environment without MEMPROXY_*, plus the upstream, the shared model, learning off
    and `settings` (`name=value` for MEMPROXY_NAME)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")} | {
        "MEMPROXY_UPSTREAM_BASE_URL": upstream_base_url,
        "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR),
        "MEMPROXY_EXTRACT_EVERY": "0",
        "MEMPROXY_SUMMARY_EVERY": "0",
        "MEMPROXY_LOG_LEVEL": "info",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        **{f"MEMPROXY_{key.upper()}": value for key, value in settings.items()},
    }


def launch(env: Mapping[str, str], data_dir: Path, log: Path) -> Process:
    """Start `python -m proxy serve` with exactly `env` (MEMPROXY_DATA_DIR is set here) on a
    free port, its output in `log`; do not wait for it (`wait_ready`)."""
    port = free_port()
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--port", str(port)],
            cwd=ROOT, env={**env, "MEMPROXY_DATA_DIR": str(data_dir)},
            stdout=out, stderr=subprocess.STDOUT,
        )
    return Process(popen, port, data_dir, log)


def wait_ready(process: Process) -> None:
    """Wait until /readyz answers 200; fail the test with the log if it exits or times out."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            pytest.fail(f"memproxy exited with {process.popen.returncode}:\n{process.output()}")
        try:
            if httpx.get(f"{process.url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    pytest.fail(f"memproxy was not ready after {START_TIMEOUT}s:\n{process.output()}")
