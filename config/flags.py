"""Per-request memory flags: settings give the defaults, `X-Memory*` headers override them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from config.choices import INJECTIONS, MAX_BUDGET, MODES, PLACEMENTS, SCOPES

if TYPE_CHECKING:
    from config.settings import Settings

_ON_OFF = {"on": True, "off": False}
_T = TypeVar("_T")


class FlagError(ValueError):
    """A header carried a value it cannot take."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True)
class Flags:
    """What memory may do for one request."""

    read: bool
    write: bool
    budget: int
    scope: str
    placement: str
    dry_run: bool = False
    compact: bool = False  # replace the middle of a conversation near the context window
    mode: str = "inject"  # "tool": memory_search offered to the model (proxy/flow/memory_tool/loop.py)
    # stable: earlier blocks of the session go back where they were and a request adds only
    # new items (the prompt prefix stays cacheable); fresh: one new block per request.
    injection: str = "stable"
    # Reorder recall's best candidates with the configured reranker (MEMPROXY_RERANK).
    rerank: bool = False

    @property
    def active(self) -> bool:
        """Whether memory does anything at all for this request."""
        return self.read or self.write or self.dry_run

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], settings: Settings) -> Flags:
        """Apply the request's X-Memory* headers to the settings' defaults; raise FlagError."""
        # Every header is checked, in this order, before any is used.
        enabled = _on_off(headers, "x-memory", settings.memory)
        read = _on_off(headers, "x-memory-read", settings.memory_read)
        write = _on_off(headers, "x-memory-write", settings.memory_write)
        dry_run = _on_off(headers, "x-memory-dry-run", False)
        compact = _on_off(headers, "x-memory-compact", settings.compact)
        rerank = _on_off(headers, "x-memory-rerank", settings.rerank != "off")
        return cls(
            read=enabled and read,
            write=enabled and write,
            budget=_budget(headers, settings.memory_budget),
            scope=_choice(headers, "x-memory-scope", SCOPES, settings.memory_scope),
            placement=_choice(
                headers, "x-memory-placement", PLACEMENTS, settings.memory_placement
            ),
            dry_run=dry_run,
            compact=enabled and compact,
            mode=_choice(headers, "x-memory-mode", MODES, settings.memory_mode),
            injection=_choice(
                headers, "x-memory-injection", INJECTIONS, settings.memory_injection
            ),
            rerank=rerank,
        )


def _on_off(headers: Mapping[str, str], name: str, default: bool) -> bool:
    return _header(headers, name, default, "'on' or 'off'", lambda text: _ON_OFF.get(text.lower()))


def _budget(headers: Mapping[str, str], default: int) -> int:
    # isascii: "²" (a latin-1 header byte) passes isdigit() but int() rejects it.
    def parse(text: str) -> int | None:
        return int(text) if text.isascii() and text.isdigit() and int(text) <= MAX_BUDGET else None

    return _header(headers, "x-memory-budget", default, f"an integer from 0 to {MAX_BUDGET}", parse)


def _choice(headers: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    def parse(text: str) -> str | None:
        return text.lower() if text.lower() in choices else None

    return _header(headers, name, default, f"one of {', '.join(choices)}", parse)


def _header(
    headers: Mapping[str, str], name: str, default: _T, must: str, parse: Callable[[str], _T | None]
) -> _T:
    """Header `name`'s value as `parse` reads it (None: not a value it takes), or `default`
    when the request does not send it; FlagError says what it `must` be."""
    raw = headers.get(name)
    if raw is None:
        return default
    value = parse(raw.strip())
    if value is None:
        raise FlagError(_title(name), f"{_title(name)} must be {must}, got {raw!r}")
    return value


def _title(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))
