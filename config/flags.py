"""Per-request memory flags: settings give the defaults, `X-Memory*` headers override them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from config.choices import INJECTIONS, MAX_BUDGET, MODES, PLACEMENTS, SCOPES

if TYPE_CHECKING:
    from config.settings import Settings

_ON_OFF = {"on": True, "off": False}


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
    raw = headers.get(name)
    value = default if raw is None else _ON_OFF.get(raw.strip().lower())
    if value is None:
        raise _bad(name, "'on' or 'off'", raw)
    return value


def _budget(headers: Mapping[str, str], default: int) -> int:
    raw = headers.get("x-memory-budget")
    if raw is None:
        return default
    text = raw.strip()
    # isascii: "²" (a latin-1 header byte) passes isdigit() but int() rejects it.
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_BUDGET:
        raise _bad("x-memory-budget", f"an integer from 0 to {MAX_BUDGET}", raw)
    return int(text)


def _choice(headers: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = headers.get(name)
    if raw is None:
        return default
    if (value := raw.strip().lower()) not in choices:
        raise _bad(name, f"one of {', '.join(choices)}", raw)
    return value


def _bad(name: str, must: str, raw: str | None) -> FlagError:
    """The error for header `name`, whose value `raw` is not what it `must` be."""
    return FlagError(_title(name), f"{_title(name)} must be {must}, got {raw!r}")


def _title(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))
