"""The language model that memory's learning jobs call: one non-streaming chat completion.

The call goes where the routing table sends the extraction model (or to
`extract_base_url` when set). Credentials, in order: `extract_api_key` (with
`extract_base_url`), the route's own key, else the key the user's client sent to that same
upstream (bring-your-own-key). Client keys live only in this object's memory while the
process runs: never in a job payload, the database or a log line; and a client key is only
ever sent to the base URL it was originally sent to.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from config import Settings
from memory import Unavailable
from proxy.errors import ProxyError, UpstreamStatus, UpstreamTimeout, UpstreamUnreachable
from proxy.upstream import Target, Upstream, read_body, url_for

MAX_ANSWER_BYTES = 4 << 20
# Provider key shapes (sk-..., sk-ant-..., masked sk-abc***xyz), as echoed in error bodies.
_KEY_LIKE = re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_*.\-]{4,}")
# A gateway's "the upstream is down" statuses: an outage, like a refused connection.
_OUTAGE_STATUSES = frozenset({502, 503, 504})


class LearningCallFailed(RuntimeError):
    """The upstream did not answer the learning call usefully (the job retries later)."""


class LearningUpstreamUnavailable(LearningCallFailed, Unavailable):
    """The learning call's upstream could not be reached (or its gateway said it is down):
    an outage the job worker waits out without spending the job's attempts."""

    def __init__(self, detail: str) -> None:
        Unavailable.__init__(self, "the learning model's upstream", detail)


class LLMClient:
    """Posts chat completions for memory's learning jobs."""

    def __init__(self, settings: Settings, upstream: Upstream) -> None:
        self.settings = settings
        self.upstream = upstream
        self._client_keys: dict[str, tuple[str, str]] = {}  # user -> (base_url, key)

    def lend_key(self, user_id: str, target: Target, key: str) -> None:
        """Let this user's learning calls to `target` use the client's own key."""
        self._client_keys[user_id] = (target.base_url, key)

    def target(self, model: str) -> Target:
        """Where a learning call for `model` goes."""
        if self.settings.extract_base_url:
            base = self.settings.extract_base_url.rstrip("/")
            return Target(base, self.settings.extract_api_key, name="extract_base_url")
        return self.upstream.target_for(model)

    async def __call__(self, model: str, messages: list[dict[str, Any]], *, user_id: str) -> str:
        """The text of the model's reply to `messages`."""
        target = self.target(model)
        key = target.api_key
        if key is None:
            lent = self._client_keys.get(user_id)
            key = lent[1] if lent is not None and lent[0] == target.base_url else None
        try:
            if target.via_litellm:
                from proxy.litellm_adapter import complete_text

                return await complete_text(
                    target, model, messages, key, timeout=self.settings.upstream_timeout
                )
            return await self._post(target, model, messages, key)
        except ProxyError as exc:
            if _is_outage(exc):
                raise LearningUpstreamUnavailable(scrub(str(exc), key)) from None
            raise LearningCallFailed(scrub(f"learning call failed: {exc}", key)) from None

    async def _post(
        self, target: Target, model: str, messages: list[dict[str, Any]], key: str | None
    ) -> str:
        headers = [("content-type", "application/json"), ("accept-encoding", "identity")]
        if key:
            headers.append(("authorization", f"Bearer {key}"))
        body = orjson.dumps({"model": model, "messages": messages, "temperature": 0})
        response = await self.upstream.open(
            "POST", url_for(target, "/v1/chat/completions"), headers, body
        )
        try:
            content = await read_body(response, limit=MAX_ANSWER_BYTES)
        finally:
            await response.aclose()
        if response.status_code >= 400:
            text = content[:300].decode("utf-8", "replace")
            if response.status_code in _OUTAGE_STATUSES:
                raise LearningUpstreamUnavailable(
                    scrub(f"HTTP {response.status_code}: {text}", key)
                )
            raise LearningCallFailed(
                scrub(f"learning call got HTTP {response.status_code}: {text}", key)
            )
        return _reply_text(content)


def _is_outage(exc: ProxyError) -> bool:
    """A connection that failed or timed out, or a gateway saying the upstream is down."""
    if isinstance(exc, UpstreamStatus):
        return exc.status in _OUTAGE_STATUSES
    return isinstance(exc, (UpstreamUnreachable, UpstreamTimeout))


def scrub(text: str, key: str | None) -> str:
    """An error text fit for the job table: the key, and anything key-like, masked."""
    if key:
        text = text.replace(key, "[key]")
    return _KEY_LIKE.sub("[key]", text)


def _reply_text(content: bytes) -> str:
    try:
        completion = orjson.loads(content)
        text = completion["choices"][0]["message"]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise LearningCallFailed(
            "learning call: the upstream's answer is not a chat completion"
        ) from None
    if not isinstance(text, str):
        raise LearningCallFailed("learning call: the reply has no text content")
    return text
