"""Providers that do not speak OpenAI's protocol, translated by litellm.

The only module that imports litellm, and only when a route names a `provider`: the
import costs seconds and the OpenAI-compatible path never needs it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response

from proxy.errors import ProxyError, UpstreamStatus, UpstreamTimeout, UpstreamUnreachable
from proxy.relay import RelayResponse, StreamOutcome
from proxy.sse import ChatReplyTee, reply_text

if TYPE_CHECKING:
    from proxy.chat import ChatCall
    from proxy.memory_step import MemoryStep
    from proxy.state import AppState
    from proxy.upstream import Target

# Never fetch the price map from the internet at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm

litellm.telemetry = False
litellm.drop_params = True


async def close_clients() -> None:
    """Close the HTTP clients litellm caches per event loop."""
    await litellm.close_litellm_async_clients()


async def forward_litellm(
    state: AppState, call: ChatCall, body: dict[str, Any], step: MemoryStep
) -> Response | RelayResponse:
    """Send a chat completion through litellm and answer in OpenAI's format."""
    target = call.target
    provider = target.provider or ""
    model = body["model"] if body["model"].startswith(f"{provider}/") else f"{provider}/{body['model']}"
    params = {k: v for k, v in body.items() if k not in ("model", "messages")}
    try:
        result = await litellm.acompletion(
            model=model, messages=body["messages"], api_key=target.api_key,
            api_base=target.base_url or None,
            timeout=state.settings.upstream_timeout, **params,
        )
    except Exception as exc:  # litellm raises its own tree; map it
        raise to_proxy_error(exc) from None
    await step.stored()  # the request's turns are committed before the reply starts
    headers = {**call.headers, **step.headers()}
    if not body.get("stream"):
        completion = result.model_dump(exclude_none=True)
        step.remember_reply(reply_text(completion), incomplete=False)
        return Response(orjson.dumps(completion), 200, headers, media_type="application/json")
    return _stream(state, result, headers, step)


def _stream(state: AppState, stream: Any, headers: dict[str, str], step: MemoryStep) -> RelayResponse:
    tee = ChatReplyTee() if step.writing else None

    async def events() -> AsyncIterator[bytes]:
        async for chunk in stream:
            data = b"data: " + orjson.dumps(chunk.model_dump(exclude_none=True)) + b"\n\n"
            if tee is not None:
                tee.feed(data)
            yield data
        yield b"data: [DONE]\n\n"

    async def close() -> None:
        closer = getattr(stream, "aclose", None)
        if closer is not None:
            await closer()

    def done(outcome: StreamOutcome) -> None:
        state.metrics.inflight_streams.dec()
        if tee is not None:
            step.remember_reply(tee.text, incomplete=not outcome.completed)

    state.metrics.inflight_streams.inc()
    return RelayResponse(
        events(), status=200, headers={**headers, "content-type": "text/event-stream"},
        close=close, on_error=to_proxy_error, on_done=done,
    )


async def complete_text(
    target: Target, model: str, messages: list[dict[str, Any]], api_key: str | None, *,
    timeout: float,
) -> str:
    """One non-streaming completion through litellm (memory's learning calls): its text."""
    provider = target.provider or ""
    name = model if model.startswith(f"{provider}/") else f"{provider}/{model}"
    try:
        result = await litellm.acompletion(
            model=name, messages=messages, api_key=api_key, api_base=target.base_url or None,
            timeout=timeout, temperature=0,
        )
    except Exception as exc:  # litellm raises its own tree; map it
        raise to_proxy_error(exc) from None
    return reply_text(result.model_dump(exclude_none=True)) or ""


def to_proxy_error(exc: Exception) -> ProxyError:
    """litellm's exceptions as memproxy's errors."""
    if isinstance(exc, ProxyError):
        return exc
    if isinstance(exc, litellm.exceptions.Timeout):
        return UpstreamTimeout(f"upstream timed out: {exc}")
    if isinstance(exc, litellm.exceptions.APIConnectionError):
        return UpstreamUnreachable(f"upstream unreachable: {exc}")
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:
        message = getattr(exc, "message", None) or str(exc)
        envelope = {"error": {"message": message, "type": type(exc).__name__, "param": None,
                              "code": None}}
        return UpstreamStatus(status, orjson.dumps(envelope), {})
    return UpstreamUnreachable(f"upstream failed: {type(exc).__name__}: {exc}")
