"""The language model that memory's learning jobs call: one non-streaming completion.

A job names the route that served its conversation (`learning_route`), and the call goes
the same way: "anthropic" conversations (served by `anthropic_base_url`) are asked as
Anthropic Messages at that host, everything else as chat completions where the routing
table sends the extraction model. `extract_base_url`, when set, takes every call as chat
completions.

Credentials, in order: the route's own key (`extract_api_key` with `extract_base_url`,
`anthropic_api_key`, a route's or the default upstream's), then `learning_api_key` when the
call goes to the host it belongs to (`learning_key_for`), else the key the user's client
sent to that same upstream (bring-your-own-key). No key is ever sent to a host other than
the one it was configured for or sent to (docs/security.md, keys that learning borrows). Client keys
live only in this object's memory while the process runs: never in a job payload, the
database or a log line; a client key is only ever sent to the base URL it was originally
sent to. After a restart a user's jobs have no borrowed key until that user's next
request (the jobs retry with backoff meanwhile).

While tracing, each call is a CLIENT span with the GenAI conventions (docs/tracing.md), under
the span of the job that asked, and the upstream gets its `traceparent`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from config import Settings
from memory import Unavailable
from proxy.http.errors import ProxyError, UpstreamStatus, UpstreamUnreachable
from proxy.upstream.client import (
    OUTAGE_STATUSES,
    Target,
    Upstream,
    anthropic_target,
    is_upstream_outage,
    read_body,
    url_for,
)
from proxy.upstream.genai_span import GenAICall, provider_name, start

if TYPE_CHECKING:
    from proxy.http.tracing import Tracing

MAX_ANSWER_BYTES = 4 << 20
OPENAI_ROUTE = "openai"  # chat completions to the model's route
ANTHROPIC_ROUTE = "anthropic"  # Messages to anthropic_base_url
ANTHROPIC_VERSION = "2023-06-01"
# Messages requires max_tokens; an extraction answer or a summary fits well within it.
LEARNING_MAX_TOKENS = 4096
# Provider key shapes (sk-..., sk-ant-..., masked sk-abc***xyz), as echoed in error bodies.
_KEY_LIKE = re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_*.\-]{4,}")


class LearningCallFailed(RuntimeError):
    """The upstream did not answer the learning call usefully (the job retries later)."""


class LearningUpstreamUnavailable(LearningCallFailed, Unavailable):
    """The learning call's upstream could not be reached (or its gateway said it is down):
    an outage the job worker waits out without spending the job's attempts."""

    def __init__(self, detail: str) -> None:
        Unavailable.__init__(self, "the learning model's upstream", detail)


def learning_route(target: Target) -> str:
    """The route a conversation served by `target` records for its learning jobs."""
    if target.key_header == "x-api-key" and not target.via_litellm:
        return ANTHROPIC_ROUTE
    return OPENAI_ROUTE


class LLMClient:
    """Posts the learning jobs' completions, each through its conversation's route."""

    def __init__(self, settings: Settings, upstream: Upstream, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.upstream = upstream
        self.tracing = tracing
        self._client_keys: dict[tuple[str, str], str] = {}  # (user, base_url) -> key
        self._failing: dict[str, str] = {}  # route -> why its last call failed

    def lend_key(self, user_id: str, target: Target, key: str) -> None:
        """Let this user's learning calls to `target` use the client's own key."""
        self._client_keys[(user_id, target.base_url)] = key

    def target(self, model: str, route: str = OPENAI_ROUTE) -> Target:
        """Where a learning call for `model` on `route` goes."""
        settings = self.settings
        if settings.extract_base_url:
            return Target(settings.extract_base_url.rstrip("/"), settings.extract_api_key,
                          name="extract_base_url")
        if route == ANTHROPIC_ROUTE and settings.anthropic_base_url:
            return anthropic_target(settings.anthropic_base_url, settings.anthropic_api_key)
        return self.upstream.target_for(model)

    async def __call__(
        self, model: str, messages: list[dict[str, Any]], *, user_id: str,
        route: str = OPENAI_ROUTE,
    ) -> str:
        """The text of the model's reply to `messages`."""
        target = self.target(model, route)
        key = target.api_key or learning_key_for(self.settings, target)
        if key is None:
            key = self._client_keys.get((user_id, target.base_url))
        call = self._span(target, model)
        try:
            text, reply = await self._ask(target, model, messages, key, route, call)
        except BaseException as exc:
            if call is not None:
                call.failed(exc)
            raise
        if call is not None:
            call.finished(reply)
        return text

    def _span(self, target: Target, model: str) -> GenAICall | None:
        """The call's CLIENT span while tracing (the body memproxy sends, as far as the
        GenAI conventions describe it)."""
        if self.tracing is None:
            return None
        anthropic = target.key_header == "x-api-key" and not target.via_litellm
        body = {"model": model, "temperature": 0,
                **({"max_tokens": LEARNING_MAX_TOKENS} if anthropic else {})}
        return start(self.tracing, target, body,
                     provider=provider_name(target, "anthropic" if anthropic else "openai"))

    async def _ask(
        self, target: Target, model: str, messages: list[dict[str, Any]], key: str | None,
        route: str, call: GenAICall | None,
    ) -> tuple[str, dict[str, Any]]:
        """The reply's text and the reply, through the target's protocol; a failure is
        noted against `route` (readiness) and raised as a LearningCallFailed."""
        trace = call.headers if call is not None else None
        try:
            if target.via_litellm:
                from proxy.upstream.litellm_transport import complete_text

                answered = await complete_text(
                    target, model, messages, key, timeout=self.settings.upstream_timeout,
                    trace=trace,
                )
            else:
                answered = await self._post(target, model, messages, key, trace)
        except ProxyError as exc:
            failure = scrub(f"learning call failed: {exc}", key)
            if isinstance(exc, UpstreamUnreachable) or (
                isinstance(exc, UpstreamStatus) and exc.status in (401, 403)
            ):
                self._failing[route] = failure[:200]
            if is_upstream_outage(exc):
                raise LearningUpstreamUnavailable(scrub(str(exc), key)) from None
            raise LearningCallFailed(failure) from None
        except LearningCallFailed as exc:
            if str(exc).startswith(("learning call got HTTP 401", "learning call got HTTP 403")):
                self._failing[route] = str(exc)[:200]
            raise
        self._failing.pop(route, None)
        return answered

    def readiness(self) -> str:
        """"ok", "off", or what keeps learning from reaching a model (no model is called:
        the configuration, and the last call of each route when it failed for good)."""
        settings = self.settings
        if not (settings.extract_every or settings.summary_every):
            return "off"
        routes = [OPENAI_ROUTE] + ([ANTHROPIC_ROUTE] if settings.anthropic_base_url else [])
        for route in routes:
            target = self.target(settings.extract_model or "", route)
            has_key = target.api_key or learning_key_for(settings, target) or target.via_litellm
            # Without proxy keys, learning borrows the client's key; a local server needs none.
            if not has_key and settings.keys_required and not _is_local(target.base_url):
                return (f"no key for learning on route {route}: set MEMPROXY_LEARNING_API_KEY"
                        f" (or {_key_setting(settings, route)})")
        for route, failure in self._failing.items():
            return f"failing on route {route}: {failure}"
        return "ok"

    async def _post(
        self, target: Target, model: str, messages: list[dict[str, Any]], key: str | None,
        trace: Mapping[str, str] | None,
    ) -> tuple[str, dict[str, Any]]:
        """The question as a chat completion; to an Anthropic host (its key goes in
        `x-api-key`) the same question as Anthropic Messages: system prompts go to `system`."""
        if target.key_header != "x-api-key":
            headers = [("authorization", f"Bearer {key}")] if key else []
            body = orjson.dumps({"model": model, "messages": messages, "temperature": 0})
            content = await self._send(target, "/v1/chat/completions", headers, body, key, trace)
            return _reply_text(content)
        headers = [("anthropic-version", ANTHROPIC_VERSION), *([("x-api-key", key)] if key else [])]
        system = "\n\n".join(str(m["content"]) for m in messages if m["role"] == "system")
        turns = [{"role": m["role"], "content": str(m["content"])}
                 for m in messages if m["role"] != "system"]
        body = orjson.dumps({"model": model, "max_tokens": LEARNING_MAX_TOKENS,
                             "temperature": 0, "system": system, "messages": turns})
        content = await self._send(target, "/v1/messages", headers, body, key, trace)
        return _message_text(content)

    async def _send(
        self, target: Target, path: str, headers: list[tuple[str, str]], body: bytes,
        key: str | None, trace: Mapping[str, str] | None,
    ) -> bytes:
        headers = [("content-type", "application/json"), ("accept-encoding", "identity"),
                   *headers, *(trace or {}).items()]
        response = await self.upstream.open("POST", url_for(target, path), headers, body)
        content = await read_body(response, limit=MAX_ANSWER_BYTES)
        if response.status_code >= 400:
            text = content[:300].decode("utf-8", "replace")
            if response.status_code in OUTAGE_STATUSES:
                raise LearningUpstreamUnavailable(
                    scrub(f"HTTP {response.status_code}: {text}", key)
                )
            raise LearningCallFailed(
                scrub(f"learning call got HTTP {response.status_code}: {text}", key)
            )
        return content


def learning_key_for(settings: Settings, target: Target) -> str | None:
    """MEMPROXY_LEARNING_API_KEY when `target` is the upstream it belongs to (same scheme,
    host and port as MEMPROXY_LEARNING_API_KEY_URL, by default the Anthropic or default
    upstream): a keyless local route must never receive it. A litellm route without a
    base URL goes where litellm decides, so it never gets it either."""
    key = settings.learning_api_key
    if key is None or not target.base_url:
        return None
    home = settings.learning_api_key_url or settings.anthropic_base_url or settings.upstream_base_url
    return key if _origin(target.base_url) == _origin(home) else None


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the port made explicit: what a key is bound to."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a malformed port matches nothing
        return (scheme, "", -1)
    default = {"http": 80, "https": 443}.get(scheme)
    return (scheme, (parts.hostname or "").lower().rstrip("."), port or default)


def scrub(text: str, key: str | None) -> str:
    """An error text fit for the job table: the key, and anything key-like, masked."""
    if key:
        text = text.replace(key, "[key]")
    return _KEY_LIKE.sub("[key]", text)


def _key_setting(settings: Settings, route: str) -> str:
    if settings.extract_base_url:
        return "MEMPROXY_EXTRACT_API_KEY"
    if route == ANTHROPIC_ROUTE:
        return "MEMPROXY_ANTHROPIC_API_KEY"
    return "MEMPROXY_UPSTREAM_API_KEY, or a route's api_key"


def _is_local(base_url: str) -> bool:
    """Whether an upstream is on this machine or a private network (a local model server,
    which usually takes no key)."""
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


def _reply_text(content: bytes) -> tuple[str, dict[str, Any]]:
    try:
        completion = orjson.loads(content)
        text = completion["choices"][0]["message"]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise LearningCallFailed(
            "learning call: the upstream's answer is not a chat completion"
        ) from None
    if not isinstance(text, str):
        raise LearningCallFailed("learning call: the reply has no text content")
    return text, completion


def _message_text(content: bytes) -> tuple[str, dict[str, Any]]:
    try:
        message = orjson.loads(content)
        blocks = message["content"]
        parts = [b["text"] for b in blocks if b.get("type") == "text"]
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise LearningCallFailed("learning call: the upstream's answer is not a message") from None
    if not parts or not all(isinstance(p, str) for p in parts):
        raise LearningCallFailed("learning call: the reply has no text content")
    return "".join(parts), message
