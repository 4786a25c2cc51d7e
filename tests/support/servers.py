"""Real servers on 127.0.0.1 for the scale-out tests: a Chroma server (`chroma run` from the
chromadb package) in a temporary directory, gone when its context exits:

    with ChromaServer() as chroma:
        settings = settings.replace(chroma_url=chroma.url)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

START_SECONDS = 60.0


class ServerUnavailable(RuntimeError):
    """The server's binaries are not installed on this machine."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def chroma_executable() -> Path:
    """`chroma` beside the running interpreter, or ServerUnavailable."""
    path = Path(sys.executable).parent / "chroma"
    if not path.exists():
        raise ServerUnavailable("the `chroma` command of the chromadb package is not installed")
    return path


class ChromaServer:
    """`chroma run` with its own data directory on a free loopback port."""

    def __init__(self) -> None:
        self.executable = chroma_executable()
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="memproxy-chroma-")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ChromaServer:
        log = open(Path(self._tmp.name) / "log", "wb")  # closed in __exit__
        self._process = subprocess.Popen(
            [str(self.executable), "run", "--path", str(Path(self._tmp.name) / "data"),
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ANONYMIZED_TELEMETRY": "False"},
        )
        self._log = log
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"chroma run exited: {self._read_log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/heartbeat", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"chroma run did not answer in {START_SECONDS:.0f} s: {self._read_log()}")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
        self._tmp.cleanup()

    def _read_log(self) -> str:
        self._log.flush()
        return (Path(self._tmp.name) / "log").read_text(errors="replace")[-2000:]
