"""What reading a stream's usage costs: the usage tap (proxy/formats/usage.py) on the
streams a zero-delay upstream sends, next to relaying the same chunks untouched.

Per API format, a stream of N content events (one chunk per event, as the scripted
upstream sends them) goes through: `relay` (the chunks iterated as they are, the floor),
`read` (the tap counting tokens, bytes unchanged) and, for chat completions, `strip` (the
tap taking out the usage chunk and the `"usage":null` fields memproxy asked for). Medians
of several rounds, in microseconds per stream and per chunk::

    .venv/bin/python -m scripts.bench_usage_tap               # 20-event streams
    .venv/bin/python -m scripts.bench_usage_tap --events 200 --streams 2000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import orjson

from proxy.formats.base import ApiFormat
from proxy.formats.chat import CHAT
from proxy.formats.messages import MESSAGES
from proxy.formats.responses import RESPONSES
from proxy.formats.usage import UsageTap
from tests.support.formats import message_events, response_events
from tests.support.scripted_upstream import chat_chunks


def _sse(events: Sequence[object]) -> list[bytes]:
    return [e if isinstance(e, bytes) else b"data: " + orjson.dumps(e) + b"\n\n" for e in events]


def streams(events: int) -> dict[str, tuple[list[bytes], Callable[[bool], UsageTap]]]:
    """Each format's chunks, as its upstream sends them, and its tap."""
    text = " ".join(f"word{i}" for i in range(events))
    chat = [*_sse(chat_chunks(text, split=events, include_usage=True, prompt_tokens=120)),
            b"data: [DONE]\n\n"]
    return {
        "chat": (chat, partial(_tap, CHAT)),
        "responses": (_sse(response_events(text, split=events, input_tokens=120)),
                      partial(_tap, RESPONSES)),
        "messages": (_sse(message_events(text, split=events, input_tokens=120)),
                     partial(_tap, MESSAGES)),
    }


def _tap(fmt: ApiFormat, strip: bool) -> UsageTap:
    return fmt.usage_tap(strip=strip)


def relay(chunks: list[bytes]) -> int:
    sent = 0
    for chunk in chunks:
        sent += len(chunk)
    return sent


def tapped(chunks: list[bytes], make: Callable[[bool], UsageTap], strip: bool) -> int:
    tap, sent = make(strip), 0
    for chunk in chunks:
        if out := tap.feed(chunk):
            sent += len(out)
    return sent + len(tap.end())


def timed(run: Callable[[], int], count: int) -> float:
    """Microseconds per call."""
    started = time.perf_counter()
    for _ in range(count):
        run()
    return (time.perf_counter() - started) / count * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_usage_tap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20, help="content events per stream")
    parser.add_argument("--streams", type=int, default=5000, help="streams per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{'format':<10} {'arm':<6} {'chunks':>6} {'us/stream':>10} {'us/chunk':>9} {'over relay':>11}")
    for name, (chunks, make) in streams(args.events).items():
        arms: dict[str, Callable[[], int]] = {
            "relay": partial(relay, chunks), "read": partial(tapped, chunks, make, False),
        }
        if name == "chat":
            arms["strip"] = partial(tapped, chunks, make, True)
        figures: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.rounds):  # arms interleaved, so drift hits all alike
            for arm, run in arms.items():
                figures[arm].append(timed(run, args.streams))
        base = statistics.median(figures["relay"])
        for arm, values in figures.items():
            median = statistics.median(values)
            print(f"{name:<10} {arm:<6} {len(chunks):>6} {median:>10.2f} {median / len(chunks):>9.3f}"
                  f" {median - base:>+11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
