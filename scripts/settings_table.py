"""Print the settings table of docs/settings.md from the Settings definition.

`python -m scripts.settings_table` prints it; paste it over the table in docs/settings.md
(tests/test_settings.py checks the page holds exactly this table).
"""

from __future__ import annotations

from config.settings import Settings, env_name, setting_fields


def default_text(name: str) -> str:
    """A setting's default as docs/settings.md shows it."""
    value = getattr(Settings(), name)
    if name == "data_dir":
        return "`$XDG_DATA_HOME/memproxy` (`~/.local/share/memproxy`)"
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return "`on`" if value else "`off`"
    return f"`{value}`"


def table() -> str:
    """The markdown table: variable, default, meaning."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for f in setting_fields():
        name = f"`{env_name(f.name)}`" if f.metadata.get("env", True) else f"`{f.name}` (TOML)"
        rows.append(f"| {name} | {default_text(f.name)} | {f.metadata['help']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
