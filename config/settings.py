"""One frozen, typed Settings object read once at start-up.

Every field has a default and a help text. Values come from, in rising priority: the
defaults below, an optional TOML file (`--config FILE` or `MEMPROXY_CONFIG`), and
`MEMPROXY_<FIELD>` environment variables. A bad value fails at start-up with a
`SettingsError` that names every bad setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from config.otel import otel_errors
from config.routing import ApiKey, Route, parse_api_keys, parse_routes
from config.sections.rerank import RerankSettings

ENV_PREFIX = "MEMPROXY_"
# MEMPROXY_* variables read elsewhere than Settings: the settings file, the CLI client
# (proxy/cli/memory.py), and compose.yaml's model folder.
OTHER_ENV = frozenset({
    "MEMPROXY_CONFIG", "MEMPROXY_URL", "MEMPROXY_KEY", "MEMPROXY_API_KEY", "MEMPROXY_USER",
    "MEMPROXY_MODEL_DIR",
})


class SettingsError(ValueError):
    """One or more settings are invalid; the message names each of them."""


@dataclass(frozen=True)
class Settings(RerankSettings):
    """All of memproxy's settings (the fields are in config/sections/). Field `x` is read
    from `MEMPROXY_X`."""

    @property
    def keys_required(self) -> bool:
        """Whether every request must show a valid proxy key (MEMPROXY_AUTH, api_keys)."""
        return self.auth == "keys" or bool(self.api_keys)

    @property
    def db_path(self) -> Path:
        """The SQLite database file."""
        return self.data_dir / "memproxy.db"

    @property
    def spool_path(self) -> Path:
        """The local spool of turns the database could not take yet."""
        return self.data_dir / "spool.sqlite3"

    @property
    def vectors_path(self) -> Path:
        """The Chroma persistent directory."""
        return self.data_dir / "vectors"

    def fact_lifetimes_days(self) -> dict[str, int]:
        """Lifetime in days of extracted facts per category (0: never expires)."""
        prefix = "fact_expiry_"
        return {
            f.name[len(prefix) : -len("_days")]: getattr(self, f.name)
            for f in setting_fields()
            if f.name.startswith(prefix)
        }

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed, each checked like a loaded value."""
        known = {f.name for f in setting_fields()}
        errors = [f"{name}: unknown setting" for name in changes if name not in known]
        values = _checked({n: v for n, v in changes.items() if n in known}, lambda n: n, errors)
        _fail_on(errors)
        return dataclasses.replace(self, **values)


def setting_fields() -> list[dataclasses.Field[Any]]:
    """Every setting, in declaration order."""
    return list(dataclasses.fields(Settings))


def env_name(name: str) -> str:
    """The environment variable that sets field `name`."""
    return ENV_PREFIX + name.upper()


def load_settings(
    env: Mapping[str, str] | None = None, config_file: Path | str | None = None, *,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Read settings from a TOML file, `MEMPROXY_*` variables and command-line `flags`
    (highest priority: a flag's value replaces the variable's before it is checked);
    raise SettingsError. `config_file` is the `--config` flag's file."""
    env = os.environ if env is None else env
    flags = {name: value for name, value in (flags or {}).items() if value is not None}
    source = "--config" if config_file else ENV_PREFIX + "CONFIG"
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    errors: list[str] = []
    raw = _read_toml(Path(config_file), errors, source) if config_file is not None else {}
    raw |= {f.name: env[env_name(f.name)] for f in setting_fields()
            if f.metadata.get("env", True) and env_name(f.name) in env} | flags
    known = [f.name for f in setting_fields()]
    errors += [f"{key}: unknown setting{_nearest(key, known)}" for key in raw if key not in known]
    errors += otel_errors(env)  # tracing's own variables (config/otel.py)

    def where(name: str) -> str:  # the flag, variable or TOML key a bad value came from
        return f"--{name}" if name in flags else env_name(name) if env_name(name) in env else name

    values = _checked({name: raw[name] for name in known if name in raw}, where, errors)
    _fail_on(errors)
    settings = Settings(**values)
    if problem := settings.rerank_problem():
        _fail_on([problem])
    return settings


def _checked(
    raw: Mapping[str, Any], where: Callable[[str], str], errors: list[str]
) -> dict[str, Any]:
    """Each of `raw`'s settings converted and checked; a bad one goes to `errors`, named by
    `where` (the variable, flag or TOML key it came from)."""
    fields = {f.name: f for f in setting_fields()}
    values = {}
    for name, value in raw.items():
        try:
            values[name] = _convert(fields[name], value)
        except (TypeError, ValueError) as exc:
            errors.append(f"{where(name)}: {exc}")
    return values


def _fail_on(errors: list[str]) -> None:
    if errors:
        raise SettingsError("invalid settings:\n  " + "\n  ".join(errors))


def _nearest(name: str, known: Iterable[str], prefix: str = "") -> str:
    """" (did you mean x?)" for the known name closest to a misspelt one, else "" (compared
    without `prefix`, which every name shares)."""
    stems = {k.removeprefix(prefix): k for k in known}
    nearest = difflib.get_close_matches(name.removeprefix(prefix), stems, n=1, cutoff=0.7)
    return f" (did you mean {stems[nearest[0]]}?)" if nearest else ""


def unknown_env_warnings(env: Mapping[str, str]) -> list[str]:
    """A warning for each MEMPROXY_* variable nothing reads (a typo is otherwise silently
    ignored, while the same typo in TOML is an error), naming the nearest known one."""
    known = {env_name(f.name) for f in setting_fields() if f.metadata.get("env", True)}
    known |= OTHER_ENV
    return [f"{name} is not a memproxy setting{_nearest(name, known, ENV_PREFIX)}; it is ignored"
            for name in sorted(env) if name.startswith(ENV_PREFIX) and name not in known]


def describe_storage(settings: Settings) -> dict[str, str]:
    """Which database and vector store are in use, fit for a log line (no passwords)."""
    database = without_password(settings.database_url) if settings.database_url else (
        f"sqlite:{settings.db_path}"
    )
    vectors = (f"chroma server {without_password(settings.chroma_url)}" if settings.chroma_url
               else f"embedded chroma {settings.vectors_path}")
    return {"database": database, "vectors": vectors}


def without_password(url: str) -> str:
    """`url` with its password left out, fit for a log line or an error message."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _read_toml(path: Path, errors: list[str], source: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        errors.append(f"{source}: cannot read {path}: {exc}")
        return {}
    # Settings may sit at the top level or under a [memproxy] table.
    section = data.pop("memproxy", {})
    return {**data, **section}


# Settings that hold an http(s) URL, and what a bad value's error calls it.
_HTTP_URLS = {"chroma_url": "a Chroma server's http(s) URL", **dict.fromkeys(
    ("upstream_base_url", "extract_base_url", "anthropic_base_url", "rerank_base_url",
     "learning_api_key_url"), "an http(s) URL")}


def _convert(f: dataclasses.Field[Any], value: Any) -> Any:
    meta = f.metadata
    result = _CONVERTERS.get(str(f.type), str)(value)
    if "choices" in meta and str(result).lower() not in meta["choices"]:
        raise ValueError(f"must be one of {', '.join(meta['choices'])}, got {value!r}")
    if "choices" in meta:
        result = str(result).lower()
    if "min" in meta and result < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}, got {value!r}")
    if "max" in meta and result > meta["max"]:
        raise ValueError(f"must be <= {meta['max']}, got {value!r}")
    if f.name == "allowed_hosts" and result is not None:
        names = [name.strip() for name in str(result).split(",")]
        if not all(names) or any(re.search(r"[/\s@]", name) for name in names):
            raise ValueError(f"must be host names separated by commas, or *, got {value!r}")
    if f.name == "database_url" and result is not None and not str(result).startswith(
        ("postgresql://", "postgres://")
    ):
        # The one networked database memproxy speaks; unset is the embedded SQLite file.
        raise ValueError(f"must be a PostgreSQL URL, postgresql://user:password@host:5432/db,"
                         f" got {without_password(str(result))!r}")
    if f.name in _HTTP_URLS and result is not None and not str(result).startswith(
        ("http://", "https://")
    ):
        raise ValueError(f"must be {_HTTP_URLS[f.name]}, got {value!r}")
    return result


def _all(value: Any, kind: type) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, kind) for v in value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"must be on/off (or true/false), got {value!r}")


def _to_number(value: Any, kind: type[int] | type[float]) -> int | float:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None


# How a value is converted, by its field's declared type (a string: the sections use
# `from __future__ import annotations`); any other type is a plain string.
_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "bool": _to_bool,
    "int": functools.partial(_to_number, kind=int),
    "float": functools.partial(_to_number, kind=float),
    "Path": lambda value: Path(str(value)).expanduser(),
    "Path | None": lambda value: None if value in (None, "") else Path(str(value)).expanduser(),
    "str | None": lambda value: None if value in (None, "") else str(value),
    "tuple[Route, ...]": lambda value: value if _all(value, Route) else parse_routes(value),
    "tuple[ApiKey, ...]": lambda value: value if _all(value, ApiKey) else parse_api_keys(value),
}
