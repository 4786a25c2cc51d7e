"""The pass-through's two paths that spend tokens, /v1/embeddings and /v1/completions: their
body is read whole (it is small: text to embed, a prompt), so a quota key's request can
reserve its estimate and a streamed completion can ask for its usage chunk; their reply is
read on its way for the upstream's `usage`, and where none comes, memproxy counts what it
saw pass: the prompt and the text it relayed (docs/usage.md, "Embeddings and legacy
completions")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from proxy.access.quota import KeptReply, estimate, output_allowance, prompt_tokens, text_tokens
from proxy.access.usage import Tally
from proxy.formats.base import as_list
from proxy.formats.usage import CHAT_MARK, ReplyUsage, UsageTap, ask_stream_usage, chat_usage
from proxy.http.relay import StreamOutcome
from proxy.http.sse import decode, json_object


@dataclass
class MeteredBody:
    """A counted request's body as read, and what memproxy changed to count it."""

    path: str
    payload: bytes  # what goes upstream
    body: dict[str, Any] = field(default_factory=dict)  # {} when it is not a JSON object
    strip_usage: bool = False  # memproxy asked for the stream's usage chunk

    @classmethod
    def read(cls, path: str, raw: bytes, *, ask_usage: bool) -> MeteredBody:
        """The body of a counted request; a streamed completion asks for its usage chunk
        (taken out of what the client sees when it did not ask itself)."""
        body = json_object(raw)
        if body is None:
            return cls(path, raw)  # the upstream judges it
        if ask_usage and path == "/v1/completions" and body.get("stream") is True:
            payload, body, strip = ask_stream_usage(raw, body)
            return cls(path, payload, body, strip)
        return cls(path, raw, body)

    @property
    def model(self) -> str:
        """The model named, for its tokenizer."""
        model = self.body.get("model")
        return model if isinstance(model, str) else ""

    def estimate(self) -> int:
        """The tokens this request may spend (a quota's reservation)."""
        if not self.body:  # a body memproxy cannot read (compressed?): by its size
            return self.prompt_tokens() + output_allowance({}, self.path)
        return estimate(self.body, self.model, raw_size=len(self.payload), route=self.path)

    def prompt_tokens(self) -> int:
        """The prompt's tokens as memproxy counts them (a body it cannot read: a token per
        4 bytes)."""
        if not self.body:
            return len(self.payload) // 4
        return prompt_tokens(self.body, self.model, raw_size=len(self.payload))


class MeteredReply:
    """Reads a counted reply's usage as it is relayed, JSON or a stream of events."""

    def __init__(self, sent: MeteredBody, tally: Tally, *, sse: bool) -> None:
        self.sent = sent
        self.tally = tally
        self.kept = KeptReply()
        self.tap = UsageTap(chat_usage, CHAT_MARK, strip=sent.strip_usage) if sse else None
        self.reader = None if sse else ReplyUsage()

    async def relay(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The reply's bytes as they go to the client (a stream's usage chunk taken out
        when memproxy asked for it)."""
        async for chunk in self.kept.watch(body):
            if self.reader is not None:
                self.reader.feed(chunk)
                yield chunk
            elif self.tap is not None and (out := self.tap.feed(chunk)):
                yield out
        if self.tap is not None and (out := self.tap.end()):
            yield out

    def done(self, outcome: StreamOutcome) -> None:
        """Count the reply: its usage, else the prompt sent and the text relayed."""
        input_tokens: int | None = None
        output_tokens: int | None = None
        if self.tap is not None:
            input_tokens, output_tokens = self.tap.input_tokens, self.tap.output_tokens
        elif self.reader is not None and (seen := self.reader.seen()) is not None:
            input_tokens, output_tokens = seen.input_tokens, seen.output_tokens
        if input_tokens is None:
            input_tokens = self.sent.prompt_tokens()
        if output_tokens is None:
            text = _completion_text(self.kept.parts, sse=self.tap is not None)
            output_tokens = self.kept.scaled(text_tokens(text, self.sent.model))
        self.tally.input_tokens, self.tally.output_tokens = input_tokens, output_tokens


def _completion_text(parts: list[bytes], *, sse: bool) -> str:
    """The text of a legacy completion's choices (an embedding has none), from a whole
    reply or from a stream's events."""
    data = b"".join(parts)
    if not sse:
        return "".join(_choice_texts(data))
    return "".join(text for event in decode(data) for text in _choice_texts(event.data))


def _choice_texts(data: bytes | str) -> list[str]:
    choices = as_list((json_object(data) or {}).get("choices"))
    return [c["text"] for c in choices if isinstance(c, dict) and isinstance(c.get("text"), str)]
