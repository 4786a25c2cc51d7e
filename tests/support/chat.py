"""One chat completion through memproxy with the official SDK: the chat helper tests share.

    reply = chat(proxy, "Which database do we use?", session="s1", user="ada")
    assert reply.text.startswith("echo:") and "x-memory-error" not in reply.headers

The SDK raises its own error classes for an error status (`openai.BadRequestError`, ...), as
it would in a client; tests that check error envelopes send raw bytes with httpx instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import openai
from openai.types.chat import ChatCompletionMessageParam


class Served(Protocol):
    """Anything serving memproxy: `tests.conftest.RunningProxy`, a process under test."""

    @property
    def base_url(self) -> str: ...


@dataclass(frozen=True)
class Reply:
    """What a chat completion answered."""

    status: int
    headers: Mapping[str, str]  # case-insensitive (the SDK's httpx Headers)
    text: str  # the assistant's content (a stream's deltas joined)
    model: str


def chat(
    proxy: Served | str,
    messages: str | Sequence[Mapping[str, Any]],
    *,
    session: str | None = None,
    user: str | None = None,
    headers: Mapping[str, str] | None = None,
    stream: bool = False,
    model: str = "gpt-4o",
    api_key: str = "sk-test",
) -> Reply:
    """Send one chat completion (a string is one user message); without `session` the
    proxy fingerprints the conversation, as it does for clients that send no header."""
    base_url = proxy if isinstance(proxy, str) else proxy.base_url
    sent = dict(headers or {})
    if session is not None:
        sent["X-Memory-Session-Id"] = session
    if user is not None:
        sent["X-Memory-User-Id"] = user
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    params = cast("list[ChatCompletionMessageParam]", [dict(m) for m in messages])
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60,
                       default_headers=sent) as client:
        create = client.chat.completions.with_raw_response.create
        if not stream:
            raw = create(model=model, messages=params)
            completion = raw.parse()
            text = completion.choices[0].message.content or "" if completion.choices else ""
            return Reply(raw.http_response.status_code, raw.headers, text, completion.model)
        streamed = create(model=model, messages=params, stream=True)
        pieces: list[str] = []
        answered = ""
        for chunk in streamed.parse():
            answered = answered or chunk.model
            pieces += [choice.delta.content or "" for choice in chunk.choices if choice.index == 0]
        return Reply(streamed.http_response.status_code, streamed.headers, "".join(pieces), answered)
