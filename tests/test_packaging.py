"""The Dockerfile and the console script point at the real entry point."""

from __future__ import annotations

import platform
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from proxy.cli.main import build_parser, main
from proxy.http.serving import cap_malloc_arenas

ROOT = Path(__file__).resolve().parents[1]


def test_console_script_is_the_cli() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "memproxy"
    assert project["scripts"]["memproxy"] == "proxy.cli.main:main"
    assert main.__module__ == "proxy.cli.main"


def test_dockerfile_runs_memproxy_serve_and_copies_every_package() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'CMD ["memproxy", "serve"]' in dockerfile
    for package in ("config", "memory", "proxy"):
        assert f"COPY {package} ./{package}" in dockerfile
    assert "pip install --no-cache-dir ." in dockerfile
    port = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("EXPOSE"))
    assert f"MEMPROXY_PORT={port}" in dockerfile
    args = build_parser().parse_args(["serve"])
    assert args.command == "serve"


def test_python_dash_m_proxy_is_the_same_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "proxy", "serve", "--help"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0 and "--port" in result.stdout


@pytest.mark.process
def test_bad_settings_stop_start_up_naming_the_setting() -> None:
    result = subprocess.run([sys.executable, "-m", "proxy", "serve"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT,
                            env={"MEMPROXY_MEMORY_BUDGET": "lots", "PATH": ""})
    assert result.returncode == 2
    assert "MEMPROXY_MEMORY_BUDGET" in result.stderr


def test_serve_caps_malloc_arenas_unless_the_operator_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert cap_malloc_arenas() is (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # glibc read it at start: left alone
    assert cap_malloc_arenas() is False
