"""A scripted OpenAI-compatible upstream on 127.0.0.1: the only fake in the project.

It also speaks OpenAI's Responses API and Anthropic's Messages (``/v1/messages``); their
bodies and event streams are built in ``tests.support.formats``.

Tests queue replies and read back what the server received (simonw/llm's fake model:
``enqueue()`` and ``history``). With nothing queued it answers like a fast, well-behaved
model ("echo: <last user message>"), which is also the benchmark mode::

    with ScriptedUpstream() as up:
        up.enqueue(ErrorReply(429, "slow down", headers={"retry-after": "0"}))
        up.enqueue(SSEReply(chat_chunks("Hi"), cut_after=2), path="/v1/chat/completions")
        client = openai.OpenAI(base_url=up.base_url, api_key="k", max_retries=0)
        ...
        assert up.history[0].json["model"] == "gpt-4o-mini"

Standalone: ``python -m scripts.scripted_upstream --port 8001 --first-token-delay 0.1:0.3``.
With ``--demo`` it plays a model that memory can learn from (tests/support/demo_model.py).
``GET /control/captured`` shows the last CAPTURED_MAX requests it received, keys masked.

There is no Starlette router: one ASGI callable dispatches on the path, which keeps the
default replies lean and gives it the raw ``send`` it needs to cut a connection abruptly.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import math
import os
import random
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tests.support import formats
from tests.support.threaded_server import ThreadedServer

FINGERPRINT = "fp_scripted"
CAPTURED_MAX = 50  # requests /control/captured keeps
CAPTURED_BODY_CHARS = 8000  # of each body
CONTROL_CAPTURED = "/control/captured"
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})


# -- replies -----------------------------------------------------------------------------


@dataclass(frozen=True)
class JSONReply:
    body: Any
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0  # before the headers


@dataclass(frozen=True)
class SSEReply:
    """Each event: str/bytes written as-is, anything else as ``data: <json>\\n\\n``."""

    events: Sequence[Any]
    status: int = 200
    first_delay: float = 0.0  # after the headers, before the first event
    delay: float = 0.0  # between events
    done: bool = True  # append ``data: [DONE]``
    cut_after: int | None = None  # close the socket after N events, without the final chunk
    headers: Mapping[str, str] = field(default_factory=dict)
    stall: tuple[int, float] | None = None  # (N, S): after N events, pause S more seconds


@dataclass(frozen=True)
class RawReply:
    body: bytes
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = "application/octet-stream"
    chunk_size: int | None = None  # stream the body chunked in pieces of this size
    chunk_delay: float = 0.0  # pause before each piece after the first (a slow body)


@dataclass(frozen=True)
class ErrorReply:
    """OpenAI's error envelope; ``type`` defaults from the status as OpenAI does."""

    status: int
    message: str = "scripted upstream error"
    type: str | None = None
    code: str | None = None
    param: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Hang:
    """Sleep before the headers, then send ``then`` (or the default reply)."""

    seconds: float
    then: Reply | None = None


@dataclass(frozen=True)
class Drop:
    """Close the connection without any response."""


Reply = JSONReply | SSEReply | RawReply | ErrorReply | Hang | Drop
Script = Reply | Mapping[str, Any] | Callable[["Received"], Reply]  # what enqueue() takes
_Queued = Reply | Callable[["Received"], Reply]


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    json: Any = None  # the parsed body, None when it is not JSON


# -- payload builders ----------------------------------------------------------------------


def chat_completion(
    content: str | None,
    *,
    model: str = "gpt-4o-mini",
    tool_calls: Sequence[Mapping[str, Any]] | None = None,
    n: int = 1,
    logprobs: bool | Mapping[str, Any] | None = None,
    usage: bool | Mapping[str, int] = True,
    prompt_tokens: int = 10,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` body; tool calls may be full or ``{"name", "arguments"}``."""
    calls = [_tool_call(i, call) for i, call in enumerate(tool_calls or ())]
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    choices = [
        {
            "index": i,
            "message": dict(message),
            "logprobs": _logprobs(content or "") if logprobs is True else logprobs or None,
            "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
        }
        for i in range(n)
    ]
    body = {**_envelope("chatcmpl-", "chat.completion", model), "choices": choices}
    if usage:
        body["usage"] = dict(usage) if isinstance(usage, Mapping) else _usage(prompt_tokens, n * _tokens(content))
    return body


def chat_chunks(
    content: str | None,
    *,
    model: str = "gpt-4o-mini",
    split: int = 3,
    include_usage: bool = False,
    tool_calls: Sequence[Mapping[str, Any]] | None = None,
    n: int = 1,
    prompt_tokens: int = 10,
    finish_reason: str | None = None,
) -> list[dict[str, Any]]:
    """``chat.completion.chunk`` events: role, ``split`` content pieces, tool calls, finish, usage."""
    base = _envelope("chatcmpl-", "chat.completion.chunk", model)
    if include_usage:
        base["usage"] = None  # OpenAI sends null on every chunk but the last

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice]}

    calls = [_tool_call(i, call) for i, call in enumerate(tool_calls or ())]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": "" if content else None}]
    deltas += [{"content": piece} for piece in (_split(content, split) if content else ())]
    for k, call in enumerate(calls):
        head = {"index": k, "id": call["id"], "type": "function"}
        fn = call["function"]
        deltas.append({"tool_calls": [{**head, "function": {"name": fn["name"], "arguments": ""}}]})
        deltas += [
            {"tool_calls": [{"index": k, "function": {"arguments": piece}}]}
            for piece in _split(fn["arguments"], split)
        ]
    events = [chunk(i, delta) for delta in deltas for i in range(n)]
    finish = finish_reason or ("tool_calls" if calls else "stop")
    events += [chunk(i, {}, finish) for i in range(n)]
    if include_usage:
        events.append({**base, "choices": [], "usage": _usage(prompt_tokens, n * _tokens(content))})
    return events


def fake_embedding(item: str | Sequence[int], dim: int = 8) -> list[float]:
    """A deterministic unit vector for one embeddings input (text or token ids)."""
    seed = item.encode() if isinstance(item, str) else orjson.dumps(list(item))
    raw = hashlib.shake_256(seed).digest(2 * dim)
    vector = [int.from_bytes(raw[i : i + 2], "little") / 32767.5 - 1.0 for i in range(0, 2 * dim, 2)]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def _envelope(prefix: str, kind: str, model: str) -> dict[str, Any]:
    return {
        "id": prefix + os.urandom(12).hex(),
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": FINGERPRINT,
    }


def _tool_call(index: int, call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = orjson.dumps(arguments).decode()
    call_id = call.get("id") or f"call_{index}_{os.urandom(6).hex()}"
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _logprobs(content: str) -> dict[str, Any]:
    tokens = re.findall(r"\S+\s*", content)
    items = [{"token": t, "logprob": -0.01, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens]
    return {"content": items, "refusal": None}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tokens(text: str | None) -> int:
    return (len(text) + 3) // 4 if text else 0


def _split(text: str, parts: int) -> list[str]:
    parts = max(1, min(parts, len(text)))
    size, extra = divmod(len(text), parts)
    pieces, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        pieces.append(text[start:end])
        start = end
    return pieces


# -- default replies (nothing queued) -------------------------------------------------------

Span = float | tuple[float, float]


class _Defaults:
    """What a well-behaved model answers, with the configured latency."""

    def __init__(self, first: Span, chunks: int | tuple[int, int], gap: Span, dim: int,
                 models: Sequence[str], seed: int | None) -> None:
        self._first = first if isinstance(first, tuple) else (first, first)
        self._chunks = chunks if isinstance(chunks, tuple) else (chunks, chunks)
        self._gap = gap if isinstance(gap, tuple) else (gap, gap)
        self._random = random.Random(seed)
        self._dim = dim
        self._models = list(models)
        self._routes: dict[tuple[str, str], Callable[[Received], Reply]] = {
            ("POST", "/chat/completions"): self.chat,
            ("POST", "/completions"): self.completions,
            ("POST", "/embeddings"): self.embeddings,
            ("GET", "/models"): self.models,
            ("POST", "/responses"): self.responses,
            ("POST", "/messages"): self.messages,
            ("POST", "/messages/count_tokens"): lambda req: JSONReply(formats.count_tokens(req.json)),
        }

    def reply(self, req: Received) -> Reply:
        route = req.path.removeprefix("/v1")
        handler = self._routes.get((req.method, route))
        if handler is not None:
            return handler(req)
        if req.method == "GET" and route.startswith("/models/"):
            return JSONReply(self._model(route.removeprefix("/models/")))
        content_type = req.headers.get("content-type")
        return JSONReply({"method": req.method, "path": req.path, "query": req.query,
                          "body_length": len(req.body), "content_type": content_type})

    def chat(self, req: Received) -> Reply:
        body = req.json
        if not isinstance(body, dict):
            return ErrorReply(400, "the body must be a JSON object")
        text = "echo: " + _last_user_text(body.get("messages"))
        model, n = str(body.get("model") or "gpt-4o-mini"), int(body.get("n") or 1)
        first, chunks, gap = self._sample()
        prompt = len(req.body) // 4
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            events = chat_chunks(text, model=model, split=chunks, include_usage=usage, n=n, prompt_tokens=prompt)
            return SSEReply(events, first_delay=first, delay=gap)
        reply = chat_completion(text, model=model, n=n, prompt_tokens=prompt)
        return JSONReply(reply, delay=first + gap * (chunks - 1))

    def responses(self, req: Received) -> Reply:
        """The Responses API: "echo: <last user input>", as a response or its events."""
        body = req.json
        if not isinstance(body, dict):
            return ErrorReply(400, "the body must be a JSON object")
        text = "echo: " + formats.responses_input_text(body)
        model, (first, chunks, gap) = str(body.get("model") or "gpt-4o-mini"), self._sample()
        tokens = len(req.body) // 4
        if body.get("stream"):
            events = formats.response_events(text, model=model, split=chunks, request=body,
                                             input_tokens=tokens)
            return SSEReply(events, first_delay=first, delay=gap, done=False)
        reply = formats.response_object(text, model=model, request=body, input_tokens=tokens)
        return JSONReply(reply, delay=first + gap * (chunks - 1))

    def messages(self, req: Received) -> Reply:
        """Anthropic's Messages: "echo: <last user text>", as a message or its events."""
        body = req.json
        if not isinstance(body, dict):
            return JSONReply(formats.anthropic_error("the body must be a JSON object"), status=400)
        text = "echo: " + formats.messages_input_text(body)
        model, (first, chunks, gap) = str(body.get("model") or "claude-scripted-1"), self._sample()
        tokens = len(req.body) // 4
        if body.get("stream"):
            events = formats.message_events(text, model=model, split=chunks, input_tokens=tokens)
            return SSEReply(events, first_delay=first, delay=gap, done=False)
        return JSONReply(formats.message_object(text, model=model, input_tokens=tokens),
                         delay=first + gap * (chunks - 1))

    def completions(self, req: Received) -> Reply:
        body = req.json if isinstance(req.json, dict) else {}
        prompt = body.get("prompt", "")
        text = "echo: " + (prompt if isinstance(prompt, str) else str(prompt[0] if prompt else ""))
        base = _envelope("cmpl-", "text_completion", str(body.get("model") or "gpt-3.5-turbo-instruct"))
        first, chunks, gap = self._sample()

        def choice(piece: str, finish: str | None) -> dict[str, Any]:
            return {**base, "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": finish}]}

        if body.get("stream"):
            events = [choice(piece, None) for piece in _split(text, chunks)] + [choice("", "stop")]
            return SSEReply(events, first_delay=first, delay=gap)
        return JSONReply({**choice(text, "stop"), "usage": _usage(len(req.body) // 4, _tokens(text))},
                         delay=first + gap * (chunks - 1))

    def embeddings(self, req: Received) -> Reply:
        body = req.json if isinstance(req.json, dict) else {}
        inputs = body.get("input", "")
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        dim = int(body.get("dimensions") or self._dim)
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        for i, item in enumerate(inputs):
            vector: Any = fake_embedding(item, dim)
            if as_base64:
                vector = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(_tokens(x) if isinstance(x, str) else len(x) for x in inputs)
        model = str(body.get("model") or "text-embedding-3-small")
        return JSONReply({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def models(self, req: Received) -> Reply:
        return JSONReply({"object": "list", "data": [self._model(m) for m in self._models]})

    def _model(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 1700000000, "owned_by": "scripted"}

    def _sample(self) -> tuple[float, int, float]:
        uniform = self._random.uniform
        return uniform(*self._first), self._random.randint(*self._chunks), uniform(*self._gap)


def _last_user_text(messages: Any) -> str:
    for message in reversed(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


# -- the ASGI side ---------------------------------------------------------------------------


class _Exchange:
    """One request's ASGI channel, plus what a Response cannot do: notice the client
    leave during a pause, and cut the socket."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self._gone: asyncio.Task[None] | None = None

    async def pause(self, seconds: float) -> bool:
        """Sleep; False when the client went away (or the server is stopping) meanwhile."""
        if seconds <= 0:
            return True
        if self._gone is None:
            self._gone = asyncio.create_task(self._until_disconnect())
        done, _ = await asyncio.wait({self._gone}, timeout=seconds)
        return not done

    async def cut(self) -> None:
        """Close the socket now: no final chunk, or no response at all if none started."""
        transport = getattr(getattr(self.send, "__self__", None), "transport", None)
        if transport is None:  # not uvicorn's cycle: an exception makes uvicorn close it
            raise ConnectionAbortedError("scripted cut")
        transport.close()
        # Wait for uvicorn to see the disconnect, so it neither logs nor answers 500.
        if not await self.pause(1.0):
            return
        transport.abort()

    def close(self) -> None:
        if self._gone is not None:
            self._gone.cancel()

    async def _until_disconnect(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass


class _App:
    def __init__(self, take: Callable[[Received], _Queued | None], defaults: _Defaults) -> None:
        self._take, self._defaults = take, defaults
        self.abandoned_streams = 0  # streams whose client left before the last event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        received = _received(scope, b"".join(chunks))
        queued = self._take(received)
        if queued is None:
            reply = self._defaults.reply(received)
        else:
            reply = queued(received) if callable(queued) else queued
        exchange = _Exchange(scope, receive, send)
        try:
            await self._serve(exchange, reply, received)
        finally:
            exchange.close()

    async def _serve(self, ex: _Exchange, reply: Reply, received: Received) -> None:
        if isinstance(reply, Hang):
            if await ex.pause(reply.seconds):
                await self._serve(ex, reply.then or self._defaults.reply(received), received)
        elif isinstance(reply, Drop):
            await ex.cut()
        elif isinstance(reply, SSEReply):
            if not await _stream(ex, reply):
                self.abandoned_streams += 1
        elif isinstance(reply, RawReply) and reply.chunk_size:
            await _chunked(ex, reply)
        elif await ex.pause(reply.delay if isinstance(reply, JSONReply) else 0.0):
            await _response(reply)(ex.scope, ex.receive, ex.send)


def _received(scope: Scope, body: bytes) -> Received:
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    query = scope["query_string"].decode("latin-1")
    return Received(scope["method"], scope["path"], query, headers, body, data)


def _response(reply: JSONReply | RawReply | ErrorReply) -> Response:
    if isinstance(reply, JSONReply):
        return Response(orjson.dumps(reply.body), reply.status, reply.headers, "application/json")
    if isinstance(reply, RawReply):
        return Response(reply.body, reply.status, reply.headers, reply.content_type)
    default_type = "requests" if reply.status == 429 else "server_error" if reply.status >= 500 else "invalid_request_error"
    error = {"message": reply.message, "type": reply.type or default_type, "param": reply.param, "code": reply.code}
    return Response(orjson.dumps({"error": error}), reply.status, reply.headers, "application/json")


def _start(status: int, content_type: str, headers: Mapping[str, str]) -> dict[str, Any]:
    merged = {"content-type": content_type, **{k.lower(): v for k, v in headers.items()}}
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in merged.items()]
    return {"type": "http.response.start", "status": status, "headers": raw}


async def _stream(ex: _Exchange, reply: SSEReply) -> bool:
    """Send the events; False when the client went away before the end."""
    extra = {"cache-control": "no-cache", **reply.headers}
    await ex.send(_start(reply.status, "text/event-stream; charset=utf-8", extra))
    for i, event in enumerate(reply.events):
        if i == reply.cut_after:
            # The cut comes when event N would have: a reset right behind the data can
            # make the client's HTTP library drop bytes it had already received.
            if await ex.pause(reply.delay):
                await ex.cut()
            return True
        pause = reply.delay if i else reply.first_delay
        if reply.stall is not None and i == reply.stall[0]:
            pause += reply.stall[1]
        if not await ex.pause(pause):
            return False
        await ex.send({"type": "http.response.body", "body": _sse(event), "more_body": True})
    if reply.cut_after is not None:
        await ex.cut()
        return True
    tail = b"data: [DONE]\n\n" if reply.done else b""
    await ex.send({"type": "http.response.body", "body": tail, "more_body": False})
    return True


def _sse(event: Any) -> bytes:
    if isinstance(event, bytes):
        return event
    if isinstance(event, str):
        return event.encode()
    return b"data: " + orjson.dumps(event) + b"\n\n"


async def _chunked(ex: _Exchange, reply: RawReply) -> None:
    await ex.send(_start(reply.status, reply.content_type, reply.headers))
    size = reply.chunk_size or len(reply.body)
    for start in range(0, len(reply.body), size):
        if start and not await ex.pause(reply.chunk_delay):
            return
        piece = reply.body[start : start + size]
        await ex.send({"type": "http.response.body", "body": piece, "more_body": True})
    await ex.send({"type": "http.response.body", "body": b"", "more_body": False})


def _shown(received: Received) -> dict[str, Any]:
    """One captured request: keys masked, the body cut to CAPTURED_BODY_CHARS."""
    headers = {name: (value[:6] + "..." if name in SECRET_HEADERS else value)
               for name, value in received.headers.items()}
    text = received.body.decode("utf-8", "replace")
    body: Any = received.json if len(text) <= CAPTURED_BODY_CHARS and received.json is not None \
        else text[:CAPTURED_BODY_CHARS]
    return {"method": received.method, "path": received.path, "headers": headers, "body": body}


# -- the server ------------------------------------------------------------------------------


class ScriptedUpstream:
    """An OpenAI-compatible server in a background thread, with queued replies and a history."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        first_token_delay: Span = 0.0,
        chunks: int | tuple[int, int] = 3,
        chunk_delay: Span = 0.0,
        embedding_dim: int = 8,
        models: Sequence[str] = ("gpt-4o-mini", "gpt-4o", "text-embedding-3-small"),
        keep_history: bool = True,
        seed: int | None = None,
    ) -> None:
        self.host, self._port, self.keep_history = host, port, keep_history
        defaults = _Defaults(first_token_delay, chunks, chunk_delay, embedding_dim, models, seed)
        self._app = _App(self._take, defaults)
        self._cond = threading.Condition()
        self._queues: dict[str | None, deque[_Queued]] = {}
        self._history: list[Received] = []
        self._captured: deque[Received] = deque(maxlen=CAPTURED_MAX)
        self._responder: Callable[[Received], Reply | None] | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("the port is chosen at start()")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def enqueue(self, *replies: Script, path: str | None = None) -> None:
        """Queue replies for the next requests, on ``path`` only or on any path (FIFO)."""
        for reply in replies:
            if not isinstance(reply, Reply | Mapping) and not callable(reply):
                raise TypeError(f"not a reply: {reply!r}")
        scripts: list[_Queued] = [JSONReply(r) if isinstance(r, Mapping) else r for r in replies]
        with self._cond:
            self._queues.setdefault(path, deque()).extend(scripts)

    def respond_with(self, responder: Callable[[Received], Reply | None] | None) -> None:
        """Answer with ``responder`` whenever nothing is queued; its None means the default."""
        with self._cond:
            self._responder = responder

    @property
    def history(self) -> list[Received]:
        """What arrived, in arrival order (a copy)."""
        with self._cond:
            return list(self._history)

    @property
    def abandoned_streams(self) -> int:
        """Streams whose client disconnected before the last event."""
        return self._app.abandoned_streams

    @property
    def pending(self) -> int:
        """How many queued replies no request has taken yet."""
        with self._cond:
            return sum(len(queue) for queue in self._queues.values())

    def captured(self) -> dict[str, Any]:
        """The last requests received, oldest first, as /control/captured shows them."""
        with self._cond:
            recent = list(self._captured)
        return {"object": "list", "data": [_shown(r) for r in recent], "kept": CAPTURED_MAX}

    def clear(self) -> None:
        with self._cond:
            self._queues.clear()
            self._history.clear()

    def wait_for(self, count: int, *, timeout: float = 5.0) -> list[Received]:
        """Block until ``count`` requests arrived (async tests: ``asyncio.to_thread``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._history) >= count, timeout):
                raise TimeoutError(f"{len(self._history)} of {count} requests after {timeout}s")
            return list(self._history)

    def _take(self, received: Received) -> _Queued | None:
        """Record a request and pop its reply: the path's queue first, then the any-path one."""
        if received.path == CONTROL_CAPTURED and received.method == "GET":
            return JSONReply(self.captured())
        with self._cond:
            self._captured.append(received)
            if self.keep_history:
                self._history.append(received)
                self._cond.notify_all()
            for key in (received.path, None):
                queue = self._queues.get(key)
                if queue:
                    return queue.popleft()
            responder = self._responder
        return responder(received) if responder is not None else None

    def start(self) -> ScriptedUpstream:
        if self._thread is not None:
            raise RuntimeError("already started")
        sock = self._listen()
        server = self._server = _Server(_config(self._app, standalone=False))
        self._thread = threading.Thread(target=self._run, args=(server, sock), daemon=True,
                                        name=f"scripted-upstream-{self._port}")
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the scripted upstream did not start")
            time.sleep(0.002)
        return self

    def stop(self) -> None:
        server, thread, loop = self._server, self._thread, self._loop
        if server is None or thread is None:
            return
        if loop is not None and not loop.is_closed():
            # Cut open connections so paused replies (Hang, delays) end now.
            loop.call_soon_threadsafe(_disconnect_all, server)
        server.stop_soon()
        thread.join(timeout=10)
        self._server = self._thread = self._loop = None

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM: the standalone benchmark mode."""
        sock = self._listen()
        print(f"scripted upstream listening on {self.base_url}", flush=True)
        # Standalone, uvicorn's own shutdown drains the clients' connections on SIGTERM.
        self._run(uvicorn.Server(_config(self._app, standalone=True)), sock)

    def __enter__(self) -> ScriptedUpstream:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._port))
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        return sock

    def _run(self, server: uvicorn.Server, sock: socket.socket) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            await server.serve(sockets=[sock])

        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(serve())
        finally:
            sock.close()


class _Server(ThreadedServer):
    """The fake's uvicorn, in a thread. stop() has cut every connection, so the shutdown
    only waits for the requests to see it: uvicorn's own first sleeps 0.1 s to let open
    connections finish, which cost most tests 0.1 s."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        await asyncio.gather(*self.server_state.tasks, return_exceptions=True)
        for server in self.servers:
            await server.wait_closed()


def _config(app: _App, *, standalone: bool) -> uvicorn.Config:
    # In a thread, leave the process's logging alone; standalone, log warnings only.
    log_options: dict[str, Any] = {"log_level": "warning"} if standalone else {"log_config": None}
    return uvicorn.Config(app, lifespan="off", ws="none", proxy_headers=False,
                          server_header=False, access_log=False, **log_options)


def _disconnect_all(server: uvicorn.Server) -> None:
    for connection in list(server.server_state.connections):
        transport = getattr(connection, "transport", None)
        if transport is not None:
            transport.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# -- command line ----------------------------------------------------------------------------


def _span(text: str) -> tuple[float, float]:
    low, _, high = text.partition(":")
    return float(low), float(high or low)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.scripted_upstream",
                                     description="A scripted OpenAI-compatible upstream.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--first-token-delay", type=_span, default=(0.0, 0.0), metavar="S[:S]")
    parser.add_argument("--chunks", type=_span, default=(3, 3), metavar="N[:N]")
    parser.add_argument("--chunk-delay", type=_span, default=(0.0, 0.0), metavar="S[:S]")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--demo", action="store_true",
                        help="play a model memory can learn from: facts from 'my name is X',"
                             " 'I like X', 'I work on X', 'I live in X'")
    args = parser.parse_args(argv)
    chunks = (int(args.chunks[0]), int(args.chunks[1]))
    upstream = ScriptedUpstream(host=args.host, port=args.port, first_token_delay=args.first_token_delay,
                                chunks=chunks, chunk_delay=args.chunk_delay, keep_history=False,
                                seed=args.seed)
    if args.demo:
        from tests.support.demo_model import DemoModel  # it builds on this module's replies

        upstream.respond_with(DemoModel())
    upstream.serve_forever()


if __name__ == "__main__":
    main()
