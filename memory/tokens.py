"""Token counting with tiktoken, per target model, without touching the network."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import tiktoken

DEFAULT_ENCODING = "cl100k_base"
# Work over more text than this runs in a worker thread (`off_loop`). tiktoken lets go of the
# GIL while it counts, and counting one 2 MB message took 0.8-1.9 s here: on the event loop,
# a stall of every other request for as long (its worst stall measured 1.9 s, 0.09 s with
# the count in a thread). Smaller texts stay on the loop, which is cheaper than a thread hop.
OFF_LOOP_CHARS = 100_000
T = TypeVar("T")
# Families that use o200k_base, matched after provider prefixes are stripped. tiktoken's own
# table depends on its version (0.7 predates o3, gpt-4.1 and gpt-5) and misses spellings such
# as a bare "o4" or "gpt-4.5".
_O200K_MODEL = re.compile(r"^(?:ft:)?(?:chatgpt-4o|gpt-4o|gpt-4\.1|gpt-4\.5|gpt-5|o1|o3|o4)\b")
# Encodings whose BPE files litellm bundles (o200k_harmony derives from o200k_base). Any other
# encoding tiktoken names (r50k_base, gpt2) would be downloaded, so it falls back instead.
_OFFLINE_ENCODINGS = frozenset(
    {"cl100k_base", "o200k_base", "o200k_harmony", "p50k_base", "p50k_edit"}
)


def ensure_offline_tiktoken() -> None:
    """Point tiktoken at litellm's bundled encodings unless TIKTOKEN_CACHE_DIR is already set."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return
    folder = litellm_tokenizers_dir()
    if folder is not None:
        os.environ["TIKTOKEN_CACHE_DIR"] = str(folder)


def litellm_tokenizers_dir() -> Path | None:
    """Return litellm's folder of tiktoken cache files, found without importing litellm."""
    # Importing litellm takes seconds (and fetches a price map unless told not to), so locate
    # the installed package from its spec instead.
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
    return folder if folder.is_dir() else None


def encoding_name_for_model(model: str) -> str:
    """Return the tiktoken encoding name to count tokens for `model`."""
    # Without provider prefixes ("openai/", "azure/gpt-4o"), in lower case.
    name = model.strip().lower().rsplit("/", 1)[-1]
    if _O200K_MODEL.match(name):
        return "o200k_base"
    try:
        known = tiktoken.encoding_name_for_model(name)
    except KeyError:
        return DEFAULT_ENCODING
    return known if known in _OFFLINE_ENCODINGS else DEFAULT_ENCODING


@functools.lru_cache(maxsize=256)
def encoding_for_model(model: str) -> tiktoken.Encoding:
    """Return the (cached) tiktoken encoding for `model`."""
    ensure_offline_tiktoken()
    return tiktoken.get_encoding(encoding_name_for_model(model))


def load_encodings() -> None:
    """Load the BPE tables that counting uses most (about 2 s for o200k_base, measured), so
    that the first request after a start does not wait for them."""
    ensure_offline_tiktoken()
    for name in (DEFAULT_ENCODING, "o200k_base"):
        tiktoken.get_encoding(name)


async def off_loop(chars: int, work: Callable[[], T]) -> T:
    """`work()`, in a worker thread when it reads more than OFF_LOOP_CHARS characters."""
    return await asyncio.to_thread(work) if chars > OFF_LOOP_CHARS else work()


def count_tokens(text: str, model: str) -> int:
    """Count the tokens of `text` as `model` would see them."""
    count = _count_cached if len(text) <= CACHED_TEXT_CHARS else _count
    return count(text, encoding_for_model(model).name)


# Recall counts the same remembered lines again and again (a user's best memories come back
# request after request), so counts of lines up to this size are kept.
CACHED_TEXT_CHARS = 2048  # with maxsize below: at most ~32 MB of text held


def _count(text: str, encoding: str) -> int:
    # disallowed_special=() counts "<|endoftext|>" typed by a user as text instead of raising.
    return len(tiktoken.get_encoding(encoding).encode(text, disallowed_special=()))


_count_cached = functools.lru_cache(maxsize=16384)(_count)
