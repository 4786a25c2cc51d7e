"""Settings: defaults, environment, TOML, validation that names the bad setting, the settings page."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import Route, SettingsError, env_name, load_settings, setting_fields
from scripts.settings_table import table

SETTINGS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_defaults_need_nothing() -> None:
    settings = load_settings(env={})
    assert settings.upstream_base_url == "https://api.openai.com/v1"
    assert settings.upstream_api_key is None
    assert settings.memory_budget == 1000
    assert settings.api_keys == ()


def test_every_field_has_help_and_the_settings_page_lists_it() -> None:
    page = SETTINGS_PAGE.read_text()
    assert table() in page, "docs/settings.md's table is stale: python -m scripts.settings_table"
    for f in setting_fields():
        assert f.metadata.get("help"), f.name
        name = env_name(f.name) if f.metadata.get("env", True) else f.name
        assert name in page, name


def test_environment_overrides_toml(tmp_path: Path) -> None:
    config = tmp_path / "memproxy.toml"
    config.write_text(
        'memory_budget = 300\nport = 9000\n'
        '[[routes]]\nmatch = "claude-*"\nprovider = "anthropic"\napi_key = "sk-ant-secret"\n'
        '[[routes]]\nmatch = "llama3"\nbase_url = "http://127.0.0.1:11434/v1"\n'
        '[[routes]]\nmatch = "claude-3-opus*"\nprovider = "anthropic"\n'
    )
    settings = load_settings(env={"MEMPROXY_CONFIG": str(config), "MEMPROXY_PORT": "9100"})
    assert settings.memory_budget == 300
    assert settings.port == 9100
    # Exact names first, then longer prefixes before shorter ones.
    assert [r.match for r in settings.routes] == ["llama3", "claude-3-opus*", "claude-*"]
    assert settings.routes[2] == Route("claude-*", None, "sk-ant-secret", "anthropic")
    assert "sk-ant-secret" not in repr(settings.routes)


def test_api_keys_with_user_binding() -> None:
    settings = load_settings(env={"MEMPROXY_API_KEYS": "key-aaaaaaaa, key-bbbbbbbb:alice"})
    assert [(k.key, k.user_id) for k in settings.api_keys] == [
        ("key-aaaaaaaa", None), ("key-bbbbbbbb", "alice")]
    assert "key-bbbbbbbb" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"MEMPROXY_PORT": "eighty"}, "MEMPROXY_PORT"),
        ({"MEMPROXY_PORT": "70000"}, "MEMPROXY_PORT"),
        ({"MEMPROXY_MEMORY": "maybe"}, "MEMPROXY_MEMORY"),
        ({"MEMPROXY_MEMORY_SCOPE": "galaxy"}, "MEMPROXY_MEMORY_SCOPE"),
        ({"MEMPROXY_UPSTREAM_BASE_URL": "ftp://x"}, "MEMPROXY_UPSTREAM_BASE_URL"),
        ({"MEMPROXY_API_KEYS": "short"}, "MEMPROXY_API_KEYS"),
        ({"MEMPROXY_MEMORY_BUDGET": "-5"}, "MEMPROXY_MEMORY_BUDGET"),
    ],
)
def test_bad_values_fail_naming_the_setting(env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        load_settings(env=env)


@pytest.mark.parametrize(
    ("name", "called"),
    [
        ("chroma_url", "a Chroma server's http(s) URL"),
        *((name, "an http(s) URL") for name in (
            "upstream_base_url", "extract_base_url", "anthropic_base_url", "rerank_base_url",
            "learning_api_key_url")),
    ],
)
def test_a_url_setting_takes_only_http_urls(name: str, called: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(env={env_name(name): "ftp://x"})
    assert f"{env_name(name)}: must be {called}, got 'ftp://x'" in str(caught.value)
    assert getattr(load_settings(env={env_name(name): "https://x"}), name) == "https://x"


def test_every_bad_setting_is_named_at_once(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('colour = "blue"\n[[routes]]\nmatch = "x"\n')
    with pytest.raises(SettingsError) as caught:
        load_settings(env={"MEMPROXY_CONFIG": str(config), "MEMPROXY_PORT": "x"})
    message = str(caught.value)
    assert "colour: unknown setting" in message
    assert "routes" in message and "MEMPROXY_PORT" in message


def test_unreadable_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="MEMPROXY_CONFIG"):
        load_settings(env={"MEMPROXY_CONFIG": str(tmp_path / "missing.toml")})


def test_replace_validates() -> None:
    settings = load_settings(env={})
    assert settings.replace(port="9001").port == 9001
    with pytest.raises(SettingsError, match="port"):
        settings.replace(port=0)


def test_the_example_toml_file_loads_and_names_only_settings() -> None:
    """config/memproxy.example.toml (issue 39): it loads, what it sets is the default unless
    its comment says otherwise, and its commented-out lines name real settings too."""
    import re
    import tomllib

    from config import Settings, load_settings
    from config.settings import setting_fields

    example = Path(__file__).parent.parent / "config" / "memproxy.example.toml"
    settings = load_settings(env={}, config_file=example)
    defaults = Settings()
    set_here = tomllib.loads(example.read_text())
    assert set_here and all(
        getattr(settings, name) == getattr(defaults, name)
        for name in set_here if name != "embedding_model_dir"
    ), set_here
    known = {f.name for f in setting_fields()}
    commented = re.findall(r"^# (\w+) = ", example.read_text(), re.M)
    assert commented and set(commented) - {"match", "base_url"} <= known, commented


def test_a_misspelt_toml_setting_is_named_with_the_nearest_known_one(tmp_path: Path) -> None:
    from config import SettingsError, load_settings

    file = tmp_path / "memproxy.toml"
    file.write_text('upstream_baseurl = "http://127.0.0.1:1/v1"\nxyzzy = 1\n')
    with pytest.raises(SettingsError) as raised:
        load_settings(env={}, config_file=file)
    said = str(raised.value)
    assert "upstream_baseurl: unknown setting (did you mean upstream_base_url?)" in said
    assert "xyzzy: unknown setting\n" in said + "\n" and "xyzzy: unknown setting (" not in said


def test_no_secret_is_shown_in_the_settings_repr() -> None:
    """A traceback, a debugger or a log line that prints the settings shows no key and no
    database password."""
    secrets = {
        "MEMPROXY_ADMIN_KEY": "admin-secret-0001", "MEMPROXY_METRICS_KEY": "metrics-secret-01",
        "MEMPROXY_UPSTREAM_API_KEY": "sk-upstream-secret", "MEMPROXY_EXTRACT_API_KEY": "sk-extract-sec",
        "MEMPROXY_LEARNING_API_KEY": "sk-learning-secret", "MEMPROXY_RERANK_API_KEY": "sk-rerank-secret",
        "MEMPROXY_ANTHROPIC_API_KEY": "sk-ant-secret-0001",
        "MEMPROXY_DATABASE_URL": "postgresql://memproxy:db-pass-0001@127.0.0.1:5432/memproxy",
    }
    settings = load_settings(env=secrets)
    assert settings.admin_key == "admin-secret-0001"  # kept, only not shown
    shown = repr(settings)
    assert "admin_key" not in shown and "upstream_base_url" in shown
    for value in secrets.values():
        assert value not in shown and "db-pass-0001" not in shown
