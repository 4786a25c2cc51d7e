"""Shared fixtures: the scripted upstream, settings, and memproxy on a real socket."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from config import Settings, load_settings
from memory.index.embeddings import LocalEmbedder
from proxy.app import create_app
from proxy.http.serving import uvicorn_config
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.servers import ChromaServer, PostgresServer, ServerUnavailable
from tests.support.threaded_server import ThreadedServer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT.parent / "shared" / "models" / "all-MiniLM-L6-v2"


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    """A scripted OpenAI-compatible server on 127.0.0.1."""
    with ScriptedUpstream() as server:
        yield server


@pytest.fixture(scope="session")
def embedder() -> LocalEmbedder:
    """The real local embedding model, loaded once for the whole run."""
    return LocalEmbedder(MODEL_DIR)


# The storage backends. A test (or a module, with `pytestmark`) marked `both_backends` runs
# on each when it uses `backend`, `database_url` or `make_settings`; otherwise on SQLite.
BACKENDS = ["sqlite", "postgres"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run `both_backends` tests once per storage backend."""
    if "backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "both_backends"
    ):
        metafunc.parametrize("backend", BACKENDS, indirect=True)


# The markers that keep a test out of the fast lane, `pytest -m "not slow"` (CONTRIBUTING.md).
SLOW_MARKERS = ("browser", "node", "postgres", "replicas", "soak", "fuzz", "process")


def runs_on_postgres(item: pytest.Item) -> bool:
    """Whether a test runs on PostgreSQL: the postgres backend, or a server as a fixture
    (the shared `postgres_server`, or a module's own `postgres` that it may stop)."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "postgres":
        return True
    return not {"postgres_server", "postgres"}.isdisjoint(getattr(item, "fixturenames", ()))


# tryfirst: the markers must be on the items before `-m` selects among them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark PostgreSQL tests `postgres`, and every test with a slow marker `slow`."""
    for item in items:
        if runs_on_postgres(item):
            item.add_marker(pytest.mark.postgres)
        if any(item.get_closest_marker(name) for name in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The storage backend of this test: "sqlite" (the default) or "postgres"."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def database_url(request: pytest.FixtureRequest, backend: str) -> str | None:
    """A fresh, empty PostgreSQL database for a postgres test; None (SQLite) otherwise."""
    if backend == "sqlite":
        return None
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.create_database()


@pytest.fixture
def new_database_url(request: pytest.FixtureRequest, backend: str) -> Callable[[], str | None]:
    """Makes another empty database of the test's backend: its URL (None for SQLite, whose
    database is the file in a data directory)."""

    def make() -> str | None:
        if backend == "sqlite":
            return None
        server: PostgresServer = request.getfixturevalue("postgres_server")
        return server.create_database()

    return make


@pytest.fixture
def make_settings(
    tmp_path: Path, upstream: ScriptedUpstream, database_url: str | None
) -> Callable[..., Settings]:
    """Settings pointing at the scripted upstream, a fresh data directory and the test's
    database."""

    def make(**changes: Any) -> Settings:
        env = {
            "MEMPROXY_UPSTREAM_BASE_URL": upstream.base_url,
            "MEMPROXY_DATA_DIR": str(tmp_path / "data"),
            "MEMPROXY_EMBEDDING_MODEL_DIR": str(MODEL_DIR),
            "MEMPROXY_LOG_LEVEL": "warning",
            "MEMPROXY_UPSTREAM_TIMEOUT": "10",
            "MEMPROXY_SHUTDOWN_GRACE_SECONDS": "5",
            # Learning calls the upstream in the background: off unless a test turns it on.
            "MEMPROXY_EXTRACT_EVERY": "0",
            "MEMPROXY_SUMMARY_EVERY": "0",
        }
        if database_url is not None:
            env["MEMPROXY_DATABASE_URL"] = database_url
        return load_settings(env=env).replace(**changes)

    return make


@dataclass
class RunningProxy:
    """memproxy served by uvicorn in a thread."""

    server: ThreadedServer
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        """Base URL of the proxy (no /v1)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What a client puts in OPENAI_BASE_URL."""
        return f"{self.url}/v1"

    @property
    def state(self) -> Any:
        """The app's typed state (for assertions on storage)."""
        return self.server.config.app.state.memproxy  # type: ignore[union-attr]

    def stop(self) -> None:
        """Shut uvicorn down and wait for the lifespan to close everything."""
        self.server.stop_soon()
        self.thread.join(timeout=30)


def serve(settings: Settings, **app_kwargs: Any) -> RunningProxy:
    """Start memproxy on a free loopback port and wait until it is ready."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # The uvicorn settings and protocol `memproxy serve` runs (proxy/http/serving.py).
    config = uvicorn_config(
        create_app(settings, **app_kwargs), settings, log_level="warning", lifespan="on"
    )
    server = ThreadedServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("memproxy did not start")
        time.sleep(0.01)
    sock.close()
    return RunningProxy(server, thread, port)


@pytest.fixture
def start_proxy(
    make_settings: Callable[..., Settings], embedder: LocalEmbedder
) -> Iterator[Callable[..., RunningProxy]]:
    """Start memproxy (memory off unless asked); stopped at the end of the test."""
    running: list[RunningProxy] = []

    def start(*, memory: bool = False, **changes: Any) -> RunningProxy:
        from memory.engine import MemoryEngine  # noqa: F401 - real engine, shared model

        settings = make_settings(**changes)
        kwargs: dict[str, Any] = {"with_memory": memory}
        if memory and settings.embedding_backend == "local":
            kwargs["embedder"] = embedder
        proxy = serve(settings, **kwargs)
        running.append(proxy)
        return proxy

    yield start
    for proxy in running:
        proxy.stop()


@pytest.fixture
def proxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    """memproxy with memory off: a pure gateway in front of the scripted upstream."""
    return start_proxy()


@pytest.fixture
def client(proxy: RunningProxy) -> Iterator[httpx.Client]:
    """A raw httpx client aimed at the proxy."""
    with httpx.Client(base_url=proxy.url, timeout=20) as http:
        yield http


CASE_COUNTS = pytest.StashKey[Counter[str]]()


@pytest.fixture(scope="session")
def case_counts(pytestconfig: pytest.Config) -> Counter[str]:
    """How many generated cases each property-based or fuzz test ran (printed at the end)."""
    return pytestconfig.stash.setdefault(CASE_COUNTS, Counter())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its case counts to the controller, which prints them."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        counts: Counter[str] = session.config.stash.get(CASE_COUNTS, Counter())
        output["case_counts"] = dict(counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The controller adds up what each worker counted (pytest-xdist's hook)."""
    counts = getattr(node, "workeroutput", {}).get("case_counts")
    if counts:
        node.config.stash.setdefault(CASE_COUNTS, Counter()).update(counts)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Print the case counts, so the CI log shows how much the fuzz tests covered."""
    counts = config.stash.get(CASE_COUNTS, None)
    if counts:
        terminalreporter.section("generated cases")
        for name, count in sorted(counts.items()):
            terminalreporter.write_line(f"{name}: {count} cases")
        terminalreporter.write_line(f"total: {sum(counts.values())} cases")


S = TypeVar("S")


def started(start: Callable[[], S]) -> S:
    """A server `start` made, or the test skipped when this machine cannot run it."""
    try:
        return start()
    except ServerUnavailable as exc:
        # CI installs everything (.ci/run): there a missing server fails instead of skipping.
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def chroma_server() -> Iterator[ChromaServer]:
    """One `chroma run` on 127.0.0.1 for the whole run; tests use their own collections."""
    with started(ChromaServer) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL cluster on 127.0.0.1 for the whole run; tests create their databases."""
    with started(PostgresServer) as server:
        yield server
