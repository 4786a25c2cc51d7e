"""Terminal output of the memory CLI: aligned tables that fit the terminal, a progress bar."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from typing import TextIO

MIN_FLEX = 12


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, flex: int = -1) -> str:
    """Rows aligned under headers; the `flex` column is cut to fit the terminal width."""
    cells = [[" ".join(str(c).split()) for c in row] for row in rows]  # one line each
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    flex %= len(headers)
    room = shutil.get_terminal_size((120, 24)).columns - sum(widths) + widths[flex]
    room -= 2 * (len(headers) - 1)
    widths[flex] = max(min(widths[flex], room), MIN_FLEX)
    lines = [_row(headers, widths), _row(["-" * w for w in widths], widths)]
    lines += [_row(row, widths) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """`n` and its noun, singular for one: "1 fact", "2 facts", "0 summaries"."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def when(timestamp: float | None) -> str:
    """A unix time as local `YYYY-MM-DD HH:MM`."""
    if timestamp is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


def _row(values: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(_fit(v, w).ljust(w) for v, w in zip(values, widths, strict=True))


def _fit(value: str, width: int) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, total: int | None, *, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.done = 0
        self._drawn = 0.0

    def advance(self, amount: int = 1) -> None:
        """Count `amount` more units and redraw at most ten times a second."""
        self.done += amount
        now = time.monotonic()
        if self.enabled and now - self._drawn >= 0.1:
            self._drawn = now
            self._draw()

    def finish(self) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if self.total:
            share = min(1.0, self.done / self.total)
            filled = int(share * 30)
            bar = "#" * filled + "." * (30 - filled)
            text = f"\r{self.label} [{bar}] {share:4.0%} {self.done}/{self.total}"
        else:
            text = f"\r{self.label} {self.done}"
        self.stream.write(text)
        self.stream.flush()
