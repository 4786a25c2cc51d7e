"""The typed state the lifespan builds and every handler reads."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from config import Settings
from memory import MemoryEngine
from proxy.access.limits import KeyLimits
from proxy.access.stored_keys import StoredKeys
from proxy.access.usage import UsageMeter
from proxy.http.metrics import Metrics
from proxy.http.shutdown import Shutdown
from proxy.upstream.client import Upstream
from proxy.upstream.llm_client import LLMClient

if TYPE_CHECKING:
    from proxy.http.tracing import Tracing


@dataclass
class AppState:
    """Resources owned by the app's lifespan."""

    settings: Settings
    upstream: Upstream
    metrics: Metrics
    memory: MemoryEngine | None = None
    llm: LLMClient | None = None
    tracing: Tracing | None = None  # while a TracerProvider traces (proxy/http/telemetry.py)
    keys: StoredKeys | None = None  # keys in the database (None: memory, so the database, off)
    usage: UsageMeter | None = None  # with the database only (docs/usage.md)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    limits: KeyLimits = field(init=False)
    shutdown: Shutdown = field(init=False)

    def __post_init__(self) -> None:
        self.limits = KeyLimits.from_settings(self.settings)
        self.shutdown = Shutdown(self.settings.shutdown_grace_seconds)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run work after the response; kept referenced until done, awaited at shutdown."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait for work after responses (replies, metrics rows) until the shutdown's deadline."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=self.shutdown.remaining())
