"""Real servers on 127.0.0.1 for the scale-out tests, each in a temporary directory and gone
when its context exits: a Chroma server (`chroma run` from the chromadb package) and
PostgreSQL (Debian's `postgresql` package):

    with ChromaServer() as chroma, PostgresServer() as postgres:
        settings = settings.replace(chroma_url=chroma.url, database_url=postgres.create_database())
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

START_SECONDS = 60.0
PORT_TRIES = 3


class ServerUnavailable(RuntimeError):
    """The server's binaries are not installed on this machine."""


class PortTaken(RuntimeError):
    """The server could not have its port: it exited at once, or another server answers."""


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, for a server to bind soon after. It is
    taken below the kernel's ephemeral range, which the system's own choices come from (a
    port 0 bind, every outgoing connection's local end), so none of those can take it in
    the meantime; and from this pytest-xdist worker's own slice of what is below, so no
    other worker hands it out. Each is handed out once a cycle through the slice."""
    for _ in range(len(_PORTS)):
        port = next(_NEXT_PORT)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # held by something else: the next one
        return port
    raise RuntimeError(f"no free port in {_PORTS}")


def _worker_ports() -> range:
    """This worker's slice of the ports from 10000 to the ephemeral range's start."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    low = 10000
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = max(1, (ephemeral - low) // workers)
    start = low + size * (worker % workers)
    return range(start, start + size)


_PORTS = _worker_ports()
# The cycle starts at a place of this process's own, so two test runs on one machine (two
# checkouts, each with its workers) rarely hand out the same port at the same time.
_START = os.getpid() % len(_PORTS)
_NEXT_PORT = itertools.cycle(itertools.chain(_PORTS[_START:], _PORTS[:_START]))


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
        self._log = open(Path(self._tmp.name) / "log", "wb")  # closed in __exit__
        # free_port() only found a port free: another test worker may bind it before Chroma
        # does. Then Chroma exits (or another server answers), and a new port is tried.
        tries = PORT_TRIES
        while True:
            try:
                self.start()
                return self
            except PortTaken:
                tries -= 1
                if not tries:
                    self.__exit__(None, None, None)
                    raise
                self.port = free_port()

    def kill(self) -> None:
        """Kill the server (-9), as a crash would; its data stays for `start`."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(10)

    def start(self) -> None:
        """Start the server (again, after `kill`) on its port and data; return once it
        answers. Raises PortTaken when it exits at once or something else answers there."""
        self._process = subprocess.Popen(
            [str(self.executable), "run", "--path", str(Path(self._tmp.name) / "data"),
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "ANONYMIZED_TELEMETRY": "False"},
        )
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise PortTaken(f"chroma run exited: {self._read_log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/heartbeat", timeout=1) as answer:
                    body = answer.read()
            except OSError:
                time.sleep(0.1)
                continue
            if b"nanosecond heartbeat" not in body:  # not Chroma's answer
                self.kill()
                raise PortTaken(f"port {self.port} answered {body[:100]!r}, not Chroma")
            return
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


# A test cluster in memory when the machine has room: the suite makes a database per test
# (about 7.5 MB and 300 files each, copied from template1), and on disk creating them cost
# ~0.13 s each and removing a few hundred at the end of the run took tens of seconds.
MEMORY_FS = Path("/dev/shm")
MEMORY_FS_MIN_FREE = 8 << 30


def scratch_dir() -> str | None:
    """Where a temporary cluster goes: /dev/shm when it has room, else the default temp dir."""
    try:
        if shutil.disk_usage(MEMORY_FS).free >= MEMORY_FS_MIN_FREE:
            return str(MEMORY_FS)
    except OSError:
        pass
    return None


def postgres_bin() -> Path:
    """The newest `/usr/lib/postgresql/*/bin`, or ServerUnavailable."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    if not found:
        raise ServerUnavailable("PostgreSQL is not installed (Debian package `postgresql`)")
    return Path(found[-1])


class PostgresServer:
    """A PostgreSQL cluster of its own (initdb) on a free loopback port.

    PostgreSQL refuses to run as root: as root (CI) the cluster belongs to the unprivileged
    `postgres` user the Debian package creates, and every command runs through runuser.
    By default the cluster lives in a temporary directory, removed at exit; given `directory`,
    it lives there and is kept (created on first use, started again on the next).
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.bin = postgres_bin()
        self.port = free_port()
        self._keep = directory is not None
        if directory is None:
            self._tmp = tempfile.mkdtemp(prefix="memproxy-pg-", dir=scratch_dir())
        else:
            directory.mkdir(parents=True, exist_ok=True)
            self._tmp = str(directory)
        self._data = Path(self._tmp) / "data"
        self._as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self._databases = 0

    def url(self, database: str = "postgres") -> str:
        """The connection URL of one database (superuser `postgres`, trusted on loopback)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database (or `name`, created if missing); return its URL."""
        if name is None:
            self._databases += 1
            name = f"test_{self._databases}"
        elif (self._data / "base").exists() and self._has_database(name):
            return self.url(name)
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def __enter__(self) -> PostgresServer:
        if self._as_user:
            shutil.chown(self._tmp, "postgres")
        if not self._keep or not (self._data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self._data), "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--locale=C.UTF-8", "--no-sync")
        try:
            self.start()
        except BaseException:
            if not self._keep:
                shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            # A kept cluster shuts down cleanly; a temporary one is thrown away.
            mode = "fast" if self._keep else "immediate"
            self._run("pg_ctl", "-D", str(self._data), "-m", mode, "-w", "stop")
        finally:
            if not self._keep:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def start(self) -> None:
        """Start the server (again, after `stop`) on its port; return once it accepts
        connections."""
        # fsync off: a test cluster never needs to survive a power cut. A small WAL bounds
        # what a cluster in memory holds beyond its databases (checkpoints cost little
        # without fsync).
        self._run("pg_ctl", "-D", str(self._data), "-l", str(Path(self._tmp) / "log"),
                  "-w", "-t", str(int(START_SECONDS)), "-o",
                  f"-h 127.0.0.1 -p {self.port} -k {self._tmp} -F -c max_connections=200"
                  " -c max_wal_size=128MB", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server as an operator would (`fast`: every connection is terminated,
        open transactions roll back); its data stays for `start`."""
        self._run("pg_ctl", "-D", str(self._data), "-m", mode, "-w", "stop")

    def restart(self, down_seconds: float = 0.0, mode: str = "fast") -> None:
        """Stop the server, keep it down `down_seconds`, start it again on the same port."""
        self.stop(mode)
        time.sleep(down_seconds)
        self.start()

    def backend_pids(self) -> list[int]:
        """The server's processes: the postmaster and its children (backends, writers)."""
        postmaster = int((self._data / "postmaster.pid").read_text().split()[0])
        children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
        return [postmaster, *(int(pid) for pid in children)]

    def _has_database(self, name: str) -> bool:
        done = subprocess.run(
            [*self._as_user, str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port),
             "-U", "postgres", "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{name}'"],
            capture_output=True, text=True, check=True)
        return done.stdout.strip() == "1"

    def _run(self, program: str, *args: str) -> None:
        done = subprocess.run([*self._as_user, str(self.bin / program), *args],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log = Path(self._tmp) / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{program} failed: {done.stderr[-2000:]} {tail}")
