"""Gateway overhead: the same load sent straight to the upstream and through memproxy.

Starts a zero-delay scripted upstream and memproxy (memory off) as subprocesses on
127.0.0.1, then alternates direct and proxied phases (ABBA across rounds, medians taken)
for JSON and streamed requests of each API format (chat completions, the Responses API,
Anthropic Messages relayed to an Anthropic-compatible upstream) at several concurrencies.
Per phase: p50/p99 latency, time to first token (streams), requests per second, and the CPU
milliseconds per request of memproxy (utime+stime from /proc), the upstream and this client::

    .venv/bin/python -m scripts.bench_overhead                 # full run, several minutes
    .venv/bin/python -m scripts.bench_overhead --quick         # smoke run, ~45 s
    .venv/bin/python -m scripts.bench_overhead --api chat      # one format only
    .venv/bin/python -m scripts.bench_overhead --json out.json
    .venv/bin/python -m scripts.bench_overhead --tracing       # what OpenTelemetry adds
    .venv/bin/python -m scripts.bench_overhead --baseline /tmp/main --stored-key

With `--tracing` it runs four memproxy processes instead, chat completions only: memory off
and on, each without and with OpenTelemetry traces (the batch exporter, its default 5 s delay,
sending to a local OTLP/HTTP receiver that counts what it gets and decodes nothing: decoding
would take CPU from the measured process on a small machine, where a real collector runs
elsewhere), and prints the CPU each request costs more with tracing on (docs/tracing.md): the
median, over rounds, of each round's difference, and the range of those differences. The two
arms of a pair (tracing off and on) take their load at the same time, each on its own
connections: run one after the other, the CPU a memory request cost moved by about 0.5 ms from
one phase to the next on the 2-core benchmark machine, more than the difference measured (a
paired phase's upstream and client CPU, in the JSON, are the pair's together). Each round
starts the processes afresh, on the same data, and warms them up: two processes of the same
code differed by up to 0.2 ms a memory request over a whole run. Recall runs in full on every
request of the memory arms (MEMPROXY_RECALL_CACHE_ENTRIES=0). After each phase both arms are
left to settle until their processes are idle again, at least 5.5 s (past the exporter's 5 s
delay), and the CPU each spends meanwhile counts to its phase, less its idle rate: the
exporter's last batch and memory's jobs are work the phase's requests made, and none of it
runs into the next phase. The load average is printed with each round. `--embeddings upstream`
has the memory arms embed through the scripted upstream instead of the local model: their
requests then cost about 6 ms of memproxy CPU instead of 15, so the same noise is a smaller
share of it (and each embedding is one more CLIENT span). `--baseline-src DIR` adds the two
arms without tracing run from another checkout (the code before tracing),
against this code with tracing off::

    git archive <commit> | tar -x -C /tmp/base
    .venv/bin/python -m scripts.bench_overhead --tracing --baseline-src /tmp/base

`--baseline DIR` adds an arm: memproxy from another source tree (e.g. `git archive main |
tar -x -C /tmp/main`), the same settings, so a change is measured against what it changes in
the same run. `--stored-key` adds one more: this tree with MEMPROXY_AUTH=keys and every
request carrying a key from the database (docs/keys.md), looked up through its cache.

The load generator is raw asyncio streams with keep-alive and pre-encoded requests, so the
client costs the same, and little, in both arms (it shares the cores with both servers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = (ROOT / "../shared/models/all-MiniLM-L6-v2").resolve()
CLK_TCK = os.sysconf("SC_CLK_TCK")
CONCURRENCY = (1, 8, 32)
KINDS = ("json", "stream")
SYSTEM = "You are a concise assistant."
QUESTION = "In one sentence, what does a reverse proxy do?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@dataclass(frozen=True)
class Api:
    """One API format: its path, a request body, and how its replies end."""

    path: str
    body: dict[str, Any]
    json_mark: bytes  # in every whole reply
    stream_end: bytes  # the end of every streamed reply


APIS = {
    "chat": Api("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": MESSAGES},
                b'"choices"', b"data: [DONE]\n\n"),
    "responses": Api("/v1/responses", {"model": "gpt-4o-mini", "instructions": SYSTEM,
                                       "input": [{"role": "user", "content": QUESTION}]},
                     b'"output"', b"}\n\n"),
    "messages": Api("/v1/messages", {"model": "claude-bench", "max_tokens": 256, "system": SYSTEM,
                                     "messages": [{"role": "user", "content": QUESTION}]},
                    b'"content"', b'{"type":"message_stop"}\n\n'),
}


class BenchError(RuntimeError):
    """A server misbehaved, so the figures would mean nothing."""


@dataclass(frozen=True)
class Phase:
    """One arm at one concurrency for one round."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None
    rps: float
    proxy_cpu_ms: float
    upstream_cpu_ms: float
    client_cpu_ms: float
    others_cores: float  # CPUs other processes kept busy meanwhile: noise


def request_bytes(
    port: int, api: Api, stream: bool, *, memory: bool = False, key: str = "sk-bench"
) -> bytes:
    """One pre-encoded keep-alive request of `api`."""
    body = orjson.dumps({**api.body, "stream": stream})
    head = (
        f"POST {api.path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\nauthorization: Bearer {key}\r\n"
        f"x-memory: {'on' if memory else 'off'}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Connection:
    """One keep-alive HTTP/1.1 connection that reads just enough to frame responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))  # asyncio sets TCP_NODELAY

    async def exchange(self, request: bytes, api: Api) -> tuple[float, float]:
        """Send one request; seconds to the first body byte and to the end of the body."""
        start = time.perf_counter()
        self.writer.write(request)
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        if not head.startswith(b"http/1.1 200"):
            raise BenchError(f"unexpected response: {head[:200]!r}")
        marker = head.find(b"\r\ncontent-length:")
        if marker >= 0:
            length = int(head[marker + 17 : head.index(b"\r\n", marker + 2)])
            tail = await self.reader.readexactly(length)
            first = end = time.perf_counter()
            if api.json_mark not in tail:
                raise BenchError(f"not a {api.path} reply: {tail[:200]!r}")
            return first - start, end - start
        first, tail = 0.0, b""
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            tail = (tail + (await self.reader.readexactly(size + 2))[:-2])[-64:]
            first = first or time.perf_counter()
        await self.reader.readuntil(b"\r\n")  # the (empty) trailer section
        if not tail.endswith(api.stream_end):
            raise BenchError(f"stream did not end with {api.stream_end!r}: {tail[-200:]!r}")
        return first - start, time.perf_counter() - start

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of unsorted values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def busy_seconds() -> float:
    """CPU time the whole machine spent busy, from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


async def run_phase(
    port: int, request: tuple[bytes, Api], concurrency: int, total: int, cap: float,
    pids: tuple[int, int],
) -> Phase:
    """Send `total` requests over `concurrency` connections (or stop at `cap` seconds)."""
    connections = [await Connection.open(port) for _ in range(concurrency)]
    latencies: list[float] = []
    firsts: list[float] = []
    remaining, deadline = total, time.perf_counter() + cap

    async def worker(connection: Connection) -> None:
        nonlocal remaining
        while remaining > 0 and time.perf_counter() < deadline:
            remaining -= 1
            first, whole = await connection.exchange(*request)
            firsts.append(first)
            latencies.append(whole)

    def snapshot() -> tuple[float, ...]:
        return cpu_seconds(pids[0]), cpu_seconds(pids[1]), time.process_time(), busy_seconds()

    before, started = snapshot(), time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in connections))
    finally:
        seconds, after = time.perf_counter() - started, snapshot()
        await asyncio.gather(*(c.close() for c in connections))
    done = len(latencies)
    if not done:
        raise BenchError(f"no request finished within {cap} s")
    spent = [b - a for a, b in zip(before, after, strict=True)]
    others = max(0.0, spent[3] - sum(spent[:3])) / seconds  # other processes on this machine
    proxy_ms, upstream_ms, client_ms = (cpu * 1000 / done for cpu in spent[:3])
    ttft = percentile(firsts, 0.5) * 1000 if b'"stream":true' in request[0] else None
    return Phase(done, seconds, percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000,
                 ttft, done / seconds, proxy_ms, upstream_ms, client_ms, others)


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serving(
    name: str, argv: list[str], env: dict[str, str], url: str, logs: Path, cwd: Path = ROOT
) -> Iterator[int]:
    """Run a server subprocess (from the checkout `cwd`) until the block ends; yield its pid
    once `url` answers 200."""
    log_path = logs / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # Ctrl-C reaches only us; we stop it
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise BenchError(f"{name} exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"{name} not ready after 90 s: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGINT)  # a graceful stop; killed if it takes too long
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def child_env(**extra: str) -> dict[str, str]:
    """This environment without HTTP proxies (loopback only), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


async def bench(
    args: argparse.Namespace, ports: dict[str, int], pids: dict[str, int], up_pid: int,
    keys: dict[str, str],
) -> dict[str, list[Phase]]:
    """Warm up, then the rounds: every phase, keyed by kind/concurrency/arm. `pids`: each
    arm's memproxy (the direct arm's is the proxy arm's, idle then); `keys`: an arm's key."""
    arms = tuple(ports)
    kinds = [f"{api}-{kind}" for api in args.api for kind in KINDS]
    requests = {
        (kind, arm): (request_bytes(ports[arm], APIS[kind.split("-")[0]], kind.endswith("stream"),
                                    key=keys.get(arm, "sk-bench")),
                      APIS[kind.split("-")[0]])
        for kind in kinds for arm in arms
    }
    for (_kind, arm), request in requests.items():
        await run_phase(ports[arm], request, 8, args.warmup, args.cap, (pids[arm], up_pid))
    phases: dict[str, list[Phase]] = {}
    for round_no in range(args.rounds):
        for kind in kinds:
            for c in args.concurrency:
                for arm in arms if round_no % 2 == 0 else arms[::-1]:  # ABBA cancels drift
                    total = args.requests * (1 if c == 1 else 2)
                    phase = await run_phase(ports[arm], requests[kind, arm], c, total, args.cap,
                                            (pids[arm], up_pid))
                    phases.setdefault(f"{kind}/{c}/{arm}", []).append(phase)
                    print(f"  round {round_no + 1} {kind:16} c={c:<3} {arm:6} p50 {phase.p50_ms:7.2f} ms"
                          f" {phase.rps:6.0f} req/s  others {phase.others_cores:.1f} CPUs", file=sys.stderr)
    return phases


def summarise(phases: dict[str, list[Phase]]) -> dict[str, Any]:
    """Medians across rounds; added p50 is the median of each round's proxy - direct."""
    rows = []
    for key, runs in phases.items():
        kind, c, arm = key.split("/")
        figures = {name: None if getattr(runs[0], name) is None
                   else statistics.median(getattr(p, name) for p in runs) for name in asdict(runs[0])}
        if arm != "direct":
            pairs = zip(phases[f"{kind}/{c}/direct"], runs, strict=True)
            figures["added_p50_ms"] = statistics.median(p.p50_ms - d.p50_ms for d, p in pairs)
        rows.append({"kind": kind, "concurrency": int(c), "arm": arm, "rounds": len(runs), **figures})
    order = [f"{api}-{kind}" for api in APIS for kind in KINDS]
    arms = ["direct", "baseline", "proxy", "stored-key"]
    rows.sort(key=lambda r: (order.index(str(r["kind"])), r["concurrency"], arms.index(str(r["arm"]))))
    return {"rows": rows}


def report(rows: list[dict[str, Any]]) -> list[str]:
    """Print the figures table and the target lines; return the target lines."""
    print(f"\n{'kind':16} {'c':>3} {'arm':10} {'p50 ms':>8} {'p99 ms':>8} {'ttft p50':>8} {'req/s':>7} "
          f"{'added p50':>9} {'proxy cpu':>9} {'upstr cpu':>9} {'clnt cpu':>8} {'others':>6}")
    for r in rows:
        ttft, added = r["ttft_p50_ms"], r.get("added_p50_ms")
        print(f"{r['kind']:16} {r['concurrency']:>3} {r['arm']:10} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{'-' if ttft is None else f'{ttft:.2f}':>8} {r['rps']:7.0f} "
              f"{'' if added is None else f'{added:+.2f}':>9} "
              f"{r['proxy_cpu_ms'] if added is not None else 0:9.2f} {r['upstream_cpu_ms']:9.2f} "
              f"{r['client_cpu_ms']:8.2f} {r['others_cores']:6.1f}")
    print("cpu: ms per request; others: CPUs busy with other processes (noise); medians of rounds\n")
    lines = []
    for arm in dict.fromkeys(r["arm"] for r in rows if r["arm"] != "direct"):
        proxy = {(r["kind"], r["concurrency"]): r for r in rows if r["arm"] == arm}
        first = min(c for _, c in proxy)
        named = "" if arm == "proxy" else f" [{arm}]"
        kinds = list(dict.fromkeys(k for k, _ in proxy))
        for kind in kinds:
            lines.append(f"added p50 at c={first} ({kind}){named}:"
                         f" {proxy[kind, first]['added_p50_ms']:.2f} ms (target <= 1.5)")
        for kind in kinds:
            cpus = {c: r["proxy_cpu_ms"] for (k, c), r in proxy.items() if k == kind}
            detail = ", ".join(f"c={c}: {cpu:.2f}" for c, cpu in cpus.items())
            lines.append(f"proxy CPU per request {kind}{named}: {max(cpus.values()):.2f} ms"
                         f" (target <= 2; {detail})")
    print("\n".join(lines))
    return lines


# --tracing: arm -> (memory on, traced); the arms compared in pairs, tracing off then on.
TRACING_ARMS = {"off": (False, False), "traced": (False, True),
                "memory": (True, False), "memory+traced": (True, True)}
TRACING_PAIRS = (("off", "traced"), ("memory", "memory+traced"))
# --baseline-src: the same two arms without tracing from another checkout, against "off".
BASELINE_ARMS = {"before": (False, False), "before+memory": (True, False)}
BASELINE_PAIRS = (("before", "off"), ("before+memory", "memory"))


SETTLE_SECONDS = 5.5  # past the batch exporter's default 5 s delay: its last batch counts
IDLE_TICK = 0.25


async def settle(pid: int, at_least: float, cap: float = 30.0) -> tuple[float, float]:
    """Wait until process `pid` is idle (no CPU for a tick), and at least `at_least` seconds;
    the CPU seconds it spent meanwhile, and the seconds waited."""
    began, start = time.monotonic(), cpu_seconds(pid)
    last = start
    while True:
        await asyncio.sleep(IDLE_TICK)
        now, waited = cpu_seconds(pid), time.monotonic() - began
        if (waited >= at_least and now == last) or waited >= cap:
            return now - start, waited
        last = now


async def idle_rates(pids: dict[str, int], arms: Sequence[str], seconds: float = 3.0) -> dict[str, float]:
    """Each settled arm's CPU seconds per second while idle (timers, the job worker's polls)."""
    for arm in arms:
        await settle(pids[arm], 0.0)
    before = {arm: cpu_seconds(pids[arm]) for arm in arms}
    await asyncio.sleep(seconds)
    return {arm: (cpu_seconds(pids[arm]) - before[arm]) / seconds for arm in arms}


async def bench_tracing(
    args: argparse.Namespace, ports: dict[str, int], pids: dict[str, int],
    start_arms: Callable[[], dict[str, int]],
) -> dict[str, list[Phase]]:
    """The rounds over the four arms, each round on arms `start_arms` (re)started and warmed
    up; every phase, keyed by kind/c/pair/arm."""
    kinds = [f"chat-{kind}" for kind in KINDS]
    arms = {**TRACING_ARMS, **(BASELINE_ARMS if args.baseline_src else {})}
    requests = {
        (kind, arm): (request_bytes(ports[arm], APIS["chat"], kind.endswith("stream"),
                                    memory=arms[arm][0]), APIS["chat"])
        for kind in kinds for arm in arms
    }
    phases: dict[str, list[Phase]] = {}
    for round_no in range(args.rounds):
        # Fresh processes each round (their data stays): two processes of the same code
        # differ by up to 0.2 ms a memory request over a whole run, one's luck, not its code.
        pids.update(start_arms())
        for (_kind, arm), request in requests.items():
            await run_phase(ports[arm], request, 8, args.warmup, args.cap, (pids[arm], pids["upstream"]))
        idle = await idle_rates(pids, list(arms))
        for kind in kinds:
            for c in args.concurrency:
                total = args.requests * (1 if c == 1 else 2)
                for pair in _pairs(args):
                    # Both arms of a pair at once, each with its own connections: the same
                    # moment of a noisy machine for both (one after the other, the CPU a
                    # request costs moved by +-0.5 ms from one phase to the next).
                    ran = await asyncio.gather(*(
                        run_phase(ports[arm], requests[kind, arm], c, total, args.cap,
                                  (pids[arm], pids["upstream"])) for arm in pair))
                    settled = await asyncio.gather(*(settle(pids[arm], SETTLE_SECONDS) for arm in pair))
                    for arm, phase, (spent, waited) in zip(pair, ran, settled, strict=True):
                        after = max(0.0, spent - idle[arm] * waited) * 1000 / phase.requests
                        phase = replace(phase, proxy_cpu_ms=phase.proxy_cpu_ms + after)
                        phases.setdefault(f"{kind}/{c}/{_pair_key(pair)}/{arm}", []).append(phase)
                        print(f"  round {round_no + 1} {kind:11} c={c:<3} {arm:13} p50"
                              f" {phase.p50_ms:7.2f} ms  proxy cpu {phase.proxy_cpu_ms:5.2f} ms/req"
                              f" ({after:.2f} after it)  load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return phases


def _pair_key(pair: tuple[str, str]) -> str:
    return f"{pair[0]}:{pair[1]}"


def _pairs(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    return TRACING_PAIRS + (BASELINE_PAIRS if args.baseline_src else ())


def report_tracing(phases: dict[str, list[Phase]], pairs: tuple[tuple[str, str], ...]) -> list[str]:
    """Print each arm's CPU and p50, and what tracing adds (median of each round's difference)."""
    lines = []
    keys = list(dict.fromkeys("/".join(key.split("/")[:2]) for key in phases))  # kind/c
    print(f"\n{'kind':11} {'c':>3} {'arm':13} {'proxy cpu':>9} {'p50 ms':>8}")
    for key in keys:
        kind, c = key.split("/")
        for off, on in pairs:
            runs = {arm: phases[f"{key}/{_pair_key((off, on))}/{arm}"] for arm in (off, on)}
            for arm, ran in runs.items():
                print(f"{kind:11} {c:>3} {arm:13} {statistics.median(p.proxy_cpu_ms for p in ran):9.2f} "
                      f"{statistics.median(p.p50_ms for p in ran):8.2f}")
            differences = [b.proxy_cpu_ms - a.proxy_cpu_ms for a, b in zip(runs[off], runs[on], strict=True)]
            memory = "memory on" if "memory" in off else "memory off"
            what = "tracing off, this code against the baseline" if off.startswith("before") \
                else f"tracing on{sampler_named()}"
            spread = f" (rounds {min(differences):+.2f} to {max(differences):+.2f})" if len(differences) > 1 else ""
            lines.append(f"added CPU per request {kind} c={c}, {memory}, {what}:"
                         f" {statistics.median(differences):+.3f} ms{spread}")
    print("cpu: ms per request of the memproxy process, until it settled; medians of rounds\n")
    print("\n".join(lines))
    return lines


def sampler_named() -> str:
    """The sampler the traced arms inherit from this environment (OTEL_TRACES_SAMPLER and
    its argument), for the report; '' for the SDK's default, which samples every request."""
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "").strip()
    if not sampler:
        return ""
    argument = os.environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    return f", sampler {sampler}" + (f" {argument}" if argument else "")


def run_tracing(args: argparse.Namespace) -> dict[str, list[Phase]]:
    """The --tracing run: the upstream, an OTLP receiver and the four memproxy processes."""
    up, sink = free_port(), free_port()
    arms = {arm: (memory, traced, ROOT) for arm, (memory, traced) in TRACING_ARMS.items()}
    if args.baseline_src:
        arms |= {arm: (memory, traced, args.baseline_src.resolve())
                 for arm, (memory, traced) in BASELINE_ARMS.items()}
    ports = {arm: free_port() for arm in arms}
    with tempfile.TemporaryDirectory(prefix="memproxy-bench-") as tmp, contextlib.ExitStack() as stack:
        pids = {"upstream": stack.enter_context(serving(
            "upstream", [sys.executable, "-m", "scripts.scripted_upstream", "--port", str(up)],
            child_env(), f"http://127.0.0.1:{up}/v1/models", Path(tmp)))}
        stack.enter_context(serving(
            "otlp", [sys.executable, "-m", "tests.support.otlp_receiver", "--port", str(sink),
                     "--count-only"],
            child_env(), f"http://127.0.0.1:{sink}/", Path(tmp)))
        running = contextlib.ExitStack()
        stack.callback(lambda: running.close())

        def start_arms() -> dict[str, int]:
            """Stop the arms' processes if running, and start them (on their data)."""
            nonlocal running
            running.close()
            running = contextlib.ExitStack()
            return {arm: running.enter_context(serving(
                arm, [sys.executable, "-m", "proxy", "serve", "--port", str(ports[arm])],
                _arm_env(args, arm, memory, traced, up, sink, tmp),
                f"http://127.0.0.1:{ports[arm]}/readyz", Path(tmp), cwd=src))
                for arm, (memory, traced, src) in arms.items()}

        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            phases = runner.run(bench_tracing(args, ports, pids, start_arms))
        received = httpx.get(f"http://127.0.0.1:{sink}/", timeout=5).json()
        print(f"the OTLP receiver got {received['exports']} exports, {received['bytes']} bytes")
        return phases


def _arm_env(args: argparse.Namespace, arm: str, memory: bool, traced: bool, up: int, sink: int,
             tmp: str) -> dict[str, str]:
    """A --tracing arm's environment: memory on or off, traced or not."""
    env = child_env(
        MEMPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{up}/v1",
        MEMPROXY_MEMORY="on" if memory else "off", MEMPROXY_RECALL_CACHE_ENTRIES="0",
        MEMPROXY_DATA_DIR=f"{tmp}/{arm}", MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR),
        MEMPROXY_LOG_LEVEL="warning", MEMPROXY_SHUTDOWN_GRACE_SECONDS="2",
        LITELLM_LOCAL_MODEL_COST_MAP="True", OTEL_SERVICE_NAME="memproxy-bench",
        MEMPROXY_EMBEDDING_BACKEND=args.embeddings,
    )
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    if traced:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink}"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per phase at c=1 (x2 above)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of alternating phases (medians)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--warmup", type=int, default=300, help="warm-up requests per arm and kind")
    parser.add_argument("--cap", type=float, default=30.0, help="seconds at most per phase")
    parser.add_argument("--api", nargs="+", choices=list(APIS), default=list(APIS),
                        help="API formats to measure (default: all)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 100 requests, 1 round (~45 s)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--tracing", action="store_true",
                        help="what OpenTelemetry traces add, memory off and on (module docstring)")
    parser.add_argument("--embeddings", choices=("local", "upstream"), default="local",
                        help="with --tracing: the memory arms embed with the local model, or"
                             " through the scripted upstream (a request's CPU is then mostly"
                             " memproxy's own, and less noisy)")
    parser.add_argument("--baseline-src", type=Path, metavar="DIR",
                        help="with --tracing: also run memproxy from this checkout, tracing off")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also measure memproxy from this source tree (arm `baseline`)")
    parser.add_argument("--stored-key", action="store_true",
                        help="also measure MEMPROXY_AUTH=keys with a stored key (arm `stored-key`)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.warmup, args.cap = 100, 1, 50, 1.5
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on kill too
    if args.tracing:
        load = os.getloadavg()[0]
        try:
            phases = run_tracing(args)
        except (BenchError, KeyboardInterrupt) as exc:
            print(f"bench_overhead: {exc if isinstance(exc, BenchError) else 'interrupted'}", file=sys.stderr)
            return 1
        targets = report_tracing(phases, _pairs(args))
        targets.append(f"load average (1 min) at the start {load:.2f}, at the end {os.getloadavg()[0]:.2f}")
        print(targets[-1])
        if args.json:
            rows = {key: [asdict(p) for p in runs] for key, runs in phases.items()}
            config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
            args.json.write_bytes(orjson.dumps({"config": config, "phases": rows, "targets": targets},
                                               option=orjson.OPT_INDENT_2))
        return 0
    up, px = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="memproxy-bench-") as tmp:
        proxy_env = child_env(  # memory off by default: the engine opens, its steps do not run
            MEMPROXY_UPSTREAM_BASE_URL=f"http://127.0.0.1:{up}/v1", MEMPROXY_MEMORY="off",
            MEMPROXY_DATA_DIR=f"{tmp}/data", MEMPROXY_EMBEDDING_MODEL_DIR=str(MODEL_DIR),
            MEMPROXY_ANTHROPIC_BASE_URL=f"http://127.0.0.1:{up}",
            MEMPROXY_LOG_LEVEL="warning", MEMPROXY_SHUTDOWN_GRACE_SECONDS="2",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
        )
        try:
            with (
                serving("upstream", [sys.executable, "-m", "scripts.scripted_upstream", "--port", str(up)],
                        child_env(), f"http://127.0.0.1:{up}/v1/models", Path(tmp)) as up_pid,
                serving("proxy", [sys.executable, "-m", "proxy", "serve", "--port", str(px)],
                        proxy_env, f"http://127.0.0.1:{px}/readyz", Path(tmp)) as px_pid,
                contextlib.ExitStack() as more,
                asyncio.Runner(loop_factory=_loop_factory()) as runner,
            ):
                ports, pids = {"direct": up, "proxy": px}, {"direct": px_pid, "proxy": px_pid}
                keys: dict[str, str] = {}
                if args.baseline:
                    ports["baseline"] = free_port()
                    pids["baseline"] = more.enter_context(serving(
                        "baseline", [sys.executable, "-m", "proxy", "serve", "--port",
                                     str(ports["baseline"])],
                        {**proxy_env, "MEMPROXY_DATA_DIR": f"{tmp}/data-baseline",
                         "PYTHONPATH": str(args.baseline.resolve())},
                        f"http://127.0.0.1:{ports['baseline']}/readyz", Path(tmp),
                        cwd=args.baseline.resolve()))
                if args.stored_key:
                    ports["stored-key"] = port = free_port()
                    pids["stored-key"] = more.enter_context(serving(
                        "stored-key", [sys.executable, "-m", "proxy", "serve", "--port", str(port)],
                        {**proxy_env, "MEMPROXY_DATA_DIR": f"{tmp}/data-keys",
                         "MEMPROXY_AUTH": "keys", "MEMPROXY_ADMIN_KEY": BENCH_ADMIN_KEY},
                        f"http://127.0.0.1:{port}/readyz", Path(tmp)))
                    keys["stored-key"] = stored_key(port)
                phases = runner.run(bench(args, ports, pids, up_pid, keys))
        except (BenchError, KeyboardInterrupt) as exc:
            print(f"bench_overhead: {exc if isinstance(exc, BenchError) else 'interrupted'}", file=sys.stderr)
            return 1
    summary = summarise(phases)
    targets = report(summary["rows"])
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                  if k != "json"}
        document = {"config": config, **summary, "targets": targets}
        args.json.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return 0


BENCH_ADMIN_KEY = "bench-admin-key-0001"


def stored_key(port: int) -> str:
    """A new key from the admin API of the memproxy on `port`."""
    made = httpx.post(f"http://127.0.0.1:{port}/v1/admin/keys", json={"user": "bench"},
                      headers={"Authorization": f"Bearer {BENCH_ADMIN_KEY}"}, timeout=30,
                      trust_env=False)
    if made.status_code != 201:
        raise BenchError(f"could not make a key: {made.status_code} {made.text[:200]}")
    return str(made.json()["key"])


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
