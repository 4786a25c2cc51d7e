"""What a quota key may spend, seen before and after a request (docs/usage.md, "Quotas").

Before: a request of a key with a token quota reserves an estimate of its tokens when it is
admitted (`estimate`: its prompt counted with the model's tokenizer, plus the output it may
ask for), so concurrent requests, on any replica, see each other's share; `refuse_unmetered`
turns away what the upstream bills but memproxy cannot see (a background response, batches
and fine-tuning through the pass-through, ...). After: `seen_tokens` counts what memproxy
saw pass (the prompt it sent and the text it relayed) for a reply whose usage never came
(a stream cut before its usage chunk, an upstream that sends none).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from config import ApiKey
from memory import count_tokens
from proxy.http.errors import InvalidRequest, PermissionDenied

# The output reserved for a request that names no maximum (max_tokens and its kin): a
# reply past it runs the key over by the difference (docs/usage.md gives the bound).
DEFAULT_OUTPUT_TOKENS = 1024
# A legacy completion without max_tokens stops at 16 tokens (OpenAI's default).
COMPLETION_DEFAULT_OUTPUT = 16
# How long a reservation counts if its request never settles it (its replica died): longer
# than any request memproxy waits for (MEMPROXY_UPSTREAM_TIMEOUT is per read, so a stream
# may run longer; its reservation then lapses early, and it still settles when it ends).
LEASE_SECONDS = 900.0
# Per chat message, the tokens a chat template adds around its content (OpenAI: 3 to 4).
MESSAGE_OVERHEAD = 4
# Past this many bytes a prompt is estimated at a token per 4 bytes, without the tokenizer
# (it takes about 1 s per MB; a quota's estimate need not be exact).
TOKENIZED_CHARS = 1 << 20
KEPT_RELAYED_BYTES = 1 << 20  # of a reply's bytes, kept to count its text if no usage came
# Fields of a request that hold no prompt text.
_NOT_PROMPT = frozenset({"model", "user", "metadata", "stream", "stream_options", "store",
                         "service_tier", "previous_response_id", "conversation",
                         "prompt_cache_key", "safety_identifier", "background"})
_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")

# Pass-through writes a quota key may make: the paths whose tokens memproxy reads, and
# those that cost no tokens. Every other POST, PUT or PATCH (batches, fine-tuning, images,
# audio, realtime, vector stores, assistants' runs...) bills what memproxy cannot count.
METERED_PATHS = frozenset({"/v1/embeddings", "/v1/completions"})
_FREE_WRITES = re.compile(
    r"^/v1/(?:files|uploads(?:/[^/]+(?:/parts|/complete|/cancel)?)?|moderations"
    r"|responses/input_tokens|responses/[^/]+/cancel|chat/completions/[^/]+)$"
)


def refuse_unmetered(key: ApiKey | None, route: str, body: Mapping[str, Any]) -> None:
    """400 for a body asking the upstream for work memproxy cannot count, on a quota key:
    a background response runs after its request ended, so its tokens never pass by."""
    if key is None or key.token_quota is None:
        return
    if route == "responses" and body.get("background") not in (None, False):
        raise InvalidRequest(
            "background responses are not available on a key with a token quota: memproxy"
            " cannot count what they spend; send the request without background",
            param="background", code="unmetered_on_quota_key",
        )


def refuse_unmetered_path(key: ApiKey | None, method: str, path: str) -> None:
    """403 for a pass-through write the upstream bills but memproxy cannot count, on a
    quota key (reads and deletes cost no tokens)."""
    if key is None or key.token_quota is None or method in ("GET", "HEAD", "DELETE", "OPTIONS"):
        return
    if path in METERED_PATHS or _FREE_WRITES.match(path):
        return
    raise PermissionDenied(
        f"{method} {path[:200]} is not available on a key with a token quota: memproxy"
        " cannot count what it spends", code="unmetered_on_quota_key",
    )


def estimate(body: Mapping[str, Any], model: str, *, raw_size: int, route: str,
             memory_tokens: int = 0) -> int:
    """The tokens a request may spend: its prompt, the memory block it may get, and the
    output it may ask for (every choice of it)."""
    return prompt_tokens(body, model, raw_size=raw_size) + memory_tokens \
        + output_allowance(body, route)


def output_allowance(body: Mapping[str, Any], route: str) -> int:
    """The output a request may ask for: its own maximum, else the documented default."""
    if route == "/v1/embeddings":
        return 0
    asked = next((v for f in _OUTPUT_FIELDS if (v := _count_of(body.get(f))) is not None), None)
    if asked is None:
        asked = COMPLETION_DEFAULT_OUTPUT if route == "/v1/completions" else DEFAULT_OUTPUT_TOKENS
    return asked * max(1, _count_of(body.get("n")) or 1)


def prompt_tokens(body: Mapping[str, Any], model: str, *, raw_size: int) -> int:
    """The prompt's tokens: every text of the body with the model's tokenizer, each token
    id of a pre-tokenized prompt as one, and each message's template overhead."""
    if raw_size > TOKENIZED_CHARS:
        return raw_size // 4
    texts: list[str] = []
    counted = _walk((v for k, v in body.items() if k not in _NOT_PROMPT), texts, listed=False)
    return counted + (count_tokens("\n".join(texts), model) if texts else 0)


def _walk(values: Iterable[Any], texts: list[str], *, listed: bool) -> int:
    """Collect the strings of `values` (nested) in `texts`; the tokens counted without the
    tokenizer (token ids, message overheads). `listed`: the values are a list's items."""
    counted = 0
    for value in values:
        if isinstance(value, str):
            texts.append(value)
        elif listed and isinstance(value, int) and not isinstance(value, bool):
            counted += 1  # a token id of a pre-tokenized prompt (a list of integers)
        elif isinstance(value, dict):
            counted += MESSAGE_OVERHEAD if "role" in value else 0
            counted += _walk(value.values(), texts, listed=False)
        elif isinstance(value, list):
            counted += _walk(value, texts, listed=True)
    return counted


def _count_of(value: Any) -> int | None:
    """`value` when it is a count (a non-negative integer), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class KeptReply:
    """The first KEPT_RELAYED_BYTES of a relayed reply and how many bytes it had in all: a
    reply whose usage never came is counted from its text (`text_tokens`)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.kept = 0
        self.total = 0

    async def watch(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`body`, unchanged, keeping its bytes as they pass."""
        async for chunk in body:
            self.total += len(chunk)
            if self.kept < KEPT_RELAYED_BYTES:
                self.parts.append(chunk)
                self.kept += len(chunk)
            yield chunk

    def scaled(self, tokens: int) -> int:
        """`tokens` counted in the kept bytes, scaled up to the whole reply."""
        return tokens if self.total <= self.kept or not self.kept else tokens * self.total // self.kept


def text_tokens(text: str, model: str) -> int:
    """The tokens of relayed text (a reply's, counted when its usage never came)."""
    if len(text) > TOKENIZED_CHARS:
        return len(text.encode()) // 4
    return count_tokens(text, model) if text else 0
