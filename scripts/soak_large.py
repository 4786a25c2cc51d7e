"""The soak's large-message phase: what a few huge messages leave behind in memproxy's memory.

`--large` users (ten by default) each send one message of `--large-mb` MB (2 by default; the
body limit is 32 MB) at the same time, half of them streamed; the scripted upstream echoes
each back, so every request stores two huge turns. Once their writes and index jobs are done
and the process has settled, its RSS must be within LARGE_RSS_LIMIT_MB of what it was idle
just before (docs/benchmarks.md, "Large messages"): what one request costs in memory is
bounded while it runs, and handed back after.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

LARGE_RSS_LIMIT_MB = 200.0
SETTLE_SECONDS = 5.0  # after the queue drained: the last job's trims and frees land
# Waits until this many more requests are written and the job queue is empty, at most this
# many seconds; whether that happened (scripts.soak.drain).
Drain = Callable[[int, float], Awaitable[bool]]
RssOf = Callable[[int], float]  # a process's resident set size in MB (scripts.soak.rss_mb)


@dataclass
class LargePhase:
    """What the large messages cost: RSS idle before, at the peak, and settled after."""

    messages: int
    megabytes: float
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    drained: bool = False
    rss_idle_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    # The slowest /healthz answer while the messages were answered and their work done: how
    # long the event loop stalled for every other request.
    worst_probe_ms: float = 0.0

    @property
    def growth_mb(self) -> float:
        return self.rss_after_mb - self.rss_idle_mb

    def as_dict(self) -> dict[str, object]:
        return {
            "messages": self.messages, "megabytes": self.megabytes, "ok": self.ok,
            "failures": self.failures, "seconds": self.seconds, "drained": self.drained,
            "rss_idle_mb": self.rss_idle_mb, "rss_peak_mb": self.rss_peak_mb,
            "rss_after_mb": self.rss_after_mb, "growth_mb": self.growth_mb,
            "worst_probe_ms": self.worst_probe_ms,
        }


def large_text(rng: random.Random, size: int) -> str:
    """About `size` characters of sentences of made-up words (each user's own)."""
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    parts: list[str] = []
    length = 0
    while length < size:
        sentence = " ".join(rng.choices(words, k=rng.randint(6, 20))).capitalize() + ". "
        parts.append(sentence)
        length += len(sentence)
    return "".join(parts)[:size]


async def send_large(http: aiohttp.ClientSession, url: str, user: str, text: str,
                     stream: bool) -> str | None:
    """One huge message; None when it was answered, else what went wrong."""
    body = {"model": "gpt-4o-mini", "stream": stream, "messages": [{"role": "user", "content": text}]}
    async with http.post(f"{url}/v1/chat/completions", json=body,
                         headers={"X-Memory-User-Id": user}) as response:
        await response.read()
        if response.status != 200:
            return f"{user}: HTTP {response.status}"
        if error := response.headers.get("X-Memory-Error"):
            return f"{user}: X-Memory-Error {error}"
    return None


async def run_large(
    url: str, pid: int, messages: int, megabytes: float, *, seed: int, drain: Drain,
    rss_mb: RssOf, timeout: float,
) -> LargePhase:
    """Send the large messages at once, wait for their work to finish, and measure RSS."""
    phase = LargePhase(messages, megabytes)
    rng = random.Random(seed)
    texts = [large_text(rng, int(megabytes * 1_000_000)) for _ in range(messages)]
    phase.rss_idle_mb = rss_mb(pid)
    started = time.perf_counter()
    watching = asyncio.create_task(_peak(phase, pid, rss_mb))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            probing = asyncio.create_task(_probe(phase, http, url))
            outcomes = await asyncio.gather(*(
                send_large(http, url, f"large-{i}", text, stream=i % 2 == 1)
                for i, text in enumerate(texts)
            ))
            del texts
            phase.failures = [failure for failure in outcomes if failure is not None]
            phase.ok = messages - len(phase.failures)
            phase.drained = await drain(messages, timeout)
            probing.cancel()
        await asyncio.sleep(SETTLE_SECONDS)
    finally:
        watching.cancel()
    phase.seconds = time.perf_counter() - started
    phase.rss_after_mb = rss_mb(pid)
    return phase


async def _peak(phase: LargePhase, pid: int, rss_mb: RssOf) -> None:
    while True:
        phase.rss_peak_mb = max(phase.rss_peak_mb, rss_mb(pid))
        await asyncio.sleep(0.5)


async def _probe(phase: LargePhase, http: aiohttp.ClientSession, url: str) -> None:
    while True:
        started = time.perf_counter()
        async with http.get(f"{url}/healthz") as response:
            await response.read()
        phase.worst_probe_ms = max(phase.worst_probe_ms, (time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.05)
