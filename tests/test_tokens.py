"""Token counting: the right encoding per model, and no network to get it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from memory.tokens import (
    count_tokens,
    encoding_for_model,
    encoding_name_for_model,
    ensure_offline_tiktoken,
    litellm_tokenizers_dir,
)


@pytest.mark.parametrize(
    "model",
    [
        "gpt-4o",
        "gpt-4o-mini",
        "gpt-4o-2024-08-06",
        "openai/gpt-4o",
        "azure/GPT-4o-mini",
        "chatgpt-4o-latest",
        "gpt-4.1",
        "gpt-4.1-nano-2025-04-14",
        "o1",
        "o1-mini",
        "o3-pro",
        "o4-mini-2025-04-16",
        "o4",
        "gpt-4.5",
        "gpt-5",
        "gpt-5-mini",
        "gpt-5.1",
        "openrouter/openai/gpt-5-nano",
        "ft:gpt-4o-mini:acme::abc123",
    ],
)
def test_o200k_families(model: str) -> None:
    assert encoding_name_for_model(model) == "o200k_base"


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4", "cl100k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("openai/gpt-3.5-turbo-0125", "cl100k_base"),
        ("text-embedding-3-small", "cl100k_base"),
        ("text-davinci-003", "p50k_base"),  # tiktoken's own table, bundled offline
        ("gpt-oss-120b", "o200k_harmony"),
        ("davinci", "cl100k_base"),  # r50k_base is not bundled: fall back, never download
        ("claude-3-5-sonnet", "cl100k_base"),
        ("llama3.1:8b", "cl100k_base"),
        ("o10-experimental", "cl100k_base"),
        ("", "cl100k_base"),
    ],
)
def test_other_models(model: str, encoding: str) -> None:
    assert encoding_name_for_model(model) == encoding


def test_litellm_bundles_the_files_tiktoken_looks_for() -> None:
    folder = litellm_tokenizers_dir()
    assert folder is not None
    expected = {
        "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    }
    for name, sha256 in expected.items():
        # tiktoken caches a file under the SHA1 of its URL and checks its SHA256 on load.
        url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
        cached = folder / hashlib.sha1(url.encode()).hexdigest()
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == sha256


def test_ensure_offline_keeps_an_explicit_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/somewhere/else")
    ensure_offline_tiktoken()
    assert os.environ["TIKTOKEN_CACHE_DIR"] == "/somewhere/else"


@pytest.mark.process
def test_counting_works_offline_without_importing_litellm() -> None:
    # A fresh interpreter: tiktoken reads TIKTOKEN_CACHE_DIR when it first loads an encoding,
    # and an unreachable proxy turns any download attempt into a failure.
    script = textwrap.dedent(
        """
        import os, sys
        from memory.tokens import count_tokens, ensure_offline_tiktoken
        ensure_offline_tiktoken()
        assert os.environ["TIKTOKEN_CACHE_DIR"].endswith("litellm_core_utils/tokenizers")
        print(count_tokens("hello world", "gpt-4o"), count_tokens("hello world", "gpt-4"),
              count_tokens("hello world", "text-davinci-003"))
        assert "litellm" not in sys.modules
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    env |= {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2", "2"]


def test_count_tokens() -> None:
    assert count_tokens("", "gpt-4o") == 0
    assert count_tokens("hello world", "openai/gpt-4o-mini") == 2
    assert count_tokens("<|endoftext|>", "gpt-4") > 1  # user text, not a special token
    assert encoding_for_model("gpt-4o") is encoding_for_model("gpt-4o")
    assert encoding_for_model("gpt-4o").name == "o200k_base"
