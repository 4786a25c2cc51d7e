"""How a setting is declared: a dataclass field with a default and a help text (and its
checks: choices, min, max, secret, env)."""

from __future__ import annotations

import os
from dataclasses import field
from pathlib import Path
from typing import Any


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/memproxy, else ~/.local/share/memproxy."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "memproxy"


def setting(default: Any, help: str, **extra: Any) -> Any:
    """A setting with a fixed default; a secret one is left out of the settings' repr."""
    return field(default=default, repr=not extra.get("secret"), metadata={"help": help, **extra})


def setting_factory(factory: Any, help: str, **extra: Any) -> Any:
    """A setting whose default is made by `factory` (mutable or computed defaults)."""
    return field(default_factory=factory, metadata={"help": help, **extra})
