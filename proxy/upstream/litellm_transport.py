"""Providers that do not speak OpenAI's protocol, translated by litellm.

The only module that imports litellm, and only when a route names a `provider`: the
import costs seconds and the OpenAI-compatible path never needs it.

litellm takes hosts, keys, headers and providers as keyword arguments, next to the API's
own parameters (`base_url`, `api_key`, `extra_headers`, `custom_llm_provider`, ...). So a
body never goes to litellm as it is: each call gets only the parameters of its API format
(an allowlist kept next to the format: `CHAT_PARAMS`, `RESPONSES_PARAMS`, `MESSAGES_PARAMS`),
and the host, key and provider come from the route alone. Failures name the route, never
an address: litellm's texts carry the host and port it tried.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Set
from dataclasses import replace
from typing import Any

import httpx
import openai
import orjson

from proxy.http.errors import ProxyError, UpstreamStatus, UpstreamTimeout, UpstreamUnreachable
from proxy.http.logs import get_logger
from proxy.http.sse import encode, reply_text
from proxy.upstream.client import Target, UpstreamHeaders

# Never fetch the price map from the internet at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm

litellm.telemetry = False
litellm.drop_params = True
# Anthropic Messages to an OpenAI-compatible upstream as chat completions (litellm's default
# is the Responses API, which most OpenAI-compatible servers do not have).
litellm.use_chat_completions_url_for_anthropic_messages = True

log = get_logger("litellm")
# What a failed connection or a timeout looks like somewhere in litellm's exception chain
# (it wraps them, sometimes as a 500 InternalServerError whose text names the address).
_TIMEOUTS = (TimeoutError, httpx.TimeoutException, openai.APITimeoutError, litellm.exceptions.Timeout)
_UNREACHABLE = (OSError, httpx.TransportError, openai.APIConnectionError,
                litellm.exceptions.APIConnectionError)


async def close_clients() -> None:
    """Close the HTTP clients litellm caches per event loop."""
    # litellm neither re-exports nor types this function.
    await litellm.close_litellm_async_clients()  # type: ignore[attr-defined, no-untyped-call]


class LitellmReply:
    """litellm's answer in the raw transport's shape (`proxy.upstream.client.UpstreamReply`): a
    status, headers and a body of bytes in OpenAI's wire format, so the route relays and
    remembers it exactly as it does an OpenAI-compatible upstream's."""

    status_code = 200

    def __init__(
        self, body: AsyncIterator[bytes], content_type: str, target: Target,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.headers: UpstreamHeaders = {"content-type": content_type}
        self._body = body
        self._target = target
        self._close = close

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body; litellm's failures come out as memproxy's errors."""
        try:
            async for chunk in self._body:
                yield chunk
        except Exception as exc:  # litellm raises its own tree, mid-stream too; map it
            raise to_proxy_error(exc, self._target) from None

    async def aclose(self) -> None:
        """Close the provider's stream (a whole body has nothing to close)."""
        if self._close is not None:
            await self._close()


async def _call(
    function: Callable[..., Awaitable[Any]], target: Target, body: dict[str, Any],
    allowed: Set[str], timeout: float, trace: Mapping[str, str] | None,
) -> Any:
    """Call one of litellm's entry points with the body's `allowed` fields (its API
    format's parameters) and the route's host and key; `trace`: the Trace Context headers
    of memproxy's CLIENT span (proxy/upstream/genai_span.py), the only headers it adds."""
    params = {name: value for name, value in body.items() if name in allowed and name != "model"}
    if trace:
        params["extra_headers"] = dict(trace)
    try:
        return await function(
            model=_model_name(target, body["model"]), api_key=target.api_key,
            api_base=target.base_url or None, timeout=timeout, **params,
        )
    except Exception as exc:  # litellm raises its own tree; map it
        raise to_proxy_error(exc, target) from None


async def _open(
    function: Callable[..., Awaitable[Any]], events: Callable[[Any], AsyncIterator[bytes]],
    target: Target, body: dict[str, Any], allowed: Set[str], *, timeout: float,
    trace: Mapping[str, str] | None = None,
) -> LitellmReply:
    """Send a request through litellm's `function`; the answer in its API format, a stream's
    events made SSE bytes by `events`."""
    result = await _call(function, target, body, allowed, timeout, trace)
    if not body.get("stream"):
        return LitellmReply(_once(orjson.dumps(_plain(result))), "application/json", target)
    close = getattr(result, "aclose", None)
    return LitellmReply(events(result), "text/event-stream", target,
                        close=close if callable(close) else None)


async def _bytes(stream: Any) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk if isinstance(chunk, bytes) else str(chunk).encode()


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _chat_events(stream: Any) -> AsyncIterator[bytes]:
    """litellm's chunk objects as the `data:` events an OpenAI upstream sends."""
    async for chunk in stream:
        yield encode(orjson.dumps(chunk.model_dump(exclude_none=True)))
    yield encode(b"[DONE]")


async def _named_events(stream: Any) -> AsyncIterator[bytes]:
    """litellm's event objects as named SSE events (`event: <type>`), as the APIs send them."""
    async for event in stream:
        data = _plain(event)
        name = data.get("type") if isinstance(data, dict) else None
        yield encode(orjson.dumps(data), name if isinstance(name, str) else None)


# Each API format's opener, by its route (`ApiFormat.open_litellm`): chat completions, the
# Responses API, and Anthropic Messages (litellm streams these as the SSE bytes Anthropic sends).
OPENERS = {
    "chat": functools.partial(_open, litellm.acompletion, _chat_events),
    "responses": functools.partial(_open, litellm.aresponses, _named_events),
    "messages": functools.partial(_open, litellm.anthropic_messages, _bytes),
}


def _plain(value: Any) -> Any:
    """A pydantic object as plain data (litellm returns both models and dicts)."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else value


def _model_name(target: Target, model: str) -> str:
    """litellm's `provider/model` name for a routed model."""
    provider = target.provider or ""
    return model if model.startswith(f"{provider}/") else f"{provider}/{model}"


async def complete_text(
    target: Target, model: str, messages: list[dict[str, Any]], api_key: str | None, *,
    timeout: float, trace: Mapping[str, str] | None = None,
) -> tuple[str, dict[str, Any]]:
    """One non-streaming completion through litellm (memory's learning calls): its text,
    and the reply as a chat completion (for its span). `trace`: the Trace Context headers
    of memproxy's CLIENT span, the only headers it adds."""
    body = {"model": model, "messages": messages, "temperature": 0}
    result = await _call(litellm.acompletion, replace(target, api_key=api_key), body, body.keys(),
                         timeout, trace)
    reply = result.model_dump(exclude_none=True)
    return reply_text(reply) or "", reply


def context_window(model: str, provider: str | None) -> int | None:
    """The model's input window in tokens from litellm's model map, None when unknown."""
    try:
        info = litellm.get_model_info(_model_name(Target("", None, provider), model) if provider else model)
    except Exception:  # litellm raises a bare Exception for a model it does not know
        return None
    window = info.get("max_input_tokens") or info.get("max_tokens")
    return window if isinstance(window, int) and window > 0 else None


def to_proxy_error(exc: Exception, target: Target) -> ProxyError:
    """litellm's exceptions as memproxy's errors, naming the route and never an address
    (the full text goes to the log)."""
    if isinstance(exc, ProxyError):
        return exc
    chain = _chain(exc)
    route = f"route {target.name}"
    log.warning("litellm call failed", extra={"route": target.name, "error": _describe(exc)})
    if any(isinstance(e, _TIMEOUTS) for e in chain):
        return UpstreamTimeout(f"upstream timed out ({route})")
    if any(isinstance(e, _UNREACHABLE) for e in chain):
        return UpstreamUnreachable(f"upstream unreachable ({route})")
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:
        # The provider's own answer, as litellm words it.
        message = getattr(exc, "message", None) or str(exc)
        envelope = {"error": {"message": message, "type": type(exc).__name__, "param": None,
                              "code": None}}
        return UpstreamStatus(status, orjson.dumps(envelope), {})
    return UpstreamUnreachable(f"upstream failed ({route}): {type(exc).__name__}")


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
