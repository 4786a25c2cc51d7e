"""scripts/bench_components.py: the component figures the tests used to print, as a quick run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

# Out of the fast lane (CONTRIBUTING.md): a benchmark's smoke run.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_a_quick_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "components.json"
    run = subprocess.run(
        [sys.executable, "-m", "scripts.bench_components", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = orjson.loads(out.read_bytes())
    assert orjson.loads(run.stdout) == figures
    embedding, store, vectors = figures["embedding"], figures["store"], figures["vectors"]
    assert 0 < embedding["query"]["p50_ms"] <= embedding["query"]["p95_ms"]
    assert embedding["document_ms"] > 0 and embedding["documents"] == 16
    resend = store["resend_20_messages"]
    assert resend["first_ms"] > 0 and 0 < resend["p50_ms"] <= resend["p95_ms"]
    assert store["chunks"] == 2 * 500 + 9 * 250 and store["users"] == 10
    for label in ("heavy_user", "light_user"):
        assert 0 < store[f"fts_k20_{label}"]["p50_ms"] <= store[f"fts_k20_{label}"]["p95_ms"]
    assert vectors["vectors"] == 640 and vectors["add_per_s"] > 0
    for key in ("query_k50_user", "query_k50_user_session"):
        assert 0 < vectors[key]["p50_ms"] <= vectors[key]["p95_ms"]
