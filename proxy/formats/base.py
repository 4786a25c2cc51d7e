"""What an API format tells the shared flow (`proxy.flow.exchange`): how its body reads, where
memory goes in it, how its replies read, and how its errors look (docs/api-formats.md).

    format      route                  memory goes into                     errors
    chat        /v1/chat/completions   the system message / before the      OpenAI's envelope
                                       last user message
    responses   /v1/responses          `instructions` / before the last     OpenAI's envelope
                                       user input item
    messages    /v1/messages           `system` / the last user message,    Anthropic's envelope
                                       after the last cache_control

Memory itself reads every format the same way: as OpenAI chat messages in text form (the
format's `Parsed.conversation`), which is what identity, recall and the turn log take.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from starlette.responses import Response

from memory import Placed
from proxy.formats.shape import Shape
from proxy.formats.usage import Reader, UsageTap
from proxy.http.errors import ProxyError
from proxy.http.sse import ReplyTee, SSEDecoder, event_payload
from proxy.upstream.client import Target, Upstream, UpstreamReply


@dataclass(frozen=True)
class Parsed:
    """A checked request body and the conversation memory reads from it."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # OpenAI chat messages, text only
    continues: str | None = None  # the id of the stored reply this request goes on from


@dataclass(frozen=True)
class Reply:
    """What memory keeps of a whole (not streamed) reply."""

    text: str
    reply_id: str | None = None
    complete: bool = True


class ApiFormat(Protocol):
    """One API format's side of the flow (the defaults: chat completions' and Responses')."""

    route: str  # metrics label and logger name
    path: str  # the upstream path, under the target's base URL
    # A later request may name a reply by its id (previous_response_id): the reply is
    # stored before the client sees its end, so that request finds it.
    continuable: bool
    params: frozenset[str]  # the body fields litellm receives (docs/security.md)
    items_field: str = "messages"  # the body's conversation, as the format lists it
    usage_mark: bytes  # a key every usage object of the format holds (proxy.formats.usage)
    read_usage: Reader  # the tokens a whole reply, or one event of its stream, reports
    tee: Callable[[], ReplyTee]  # a reader for this format's event stream

    def parse(self, raw: bytes) -> Parsed:
        """Decode and check a body; a malformed one is a 400 (an InvalidRequest)."""
        ...

    def target(self, upstream: Upstream, model: str, headers: Mapping[str, str]) -> Target:
        """Where this format's request for `model` goes: the model's route (the routing
        table, else the default upstream)."""
        return upstream.target_for(model)

    def inject(self, body: dict[str, Any], block: str, placement: str) -> dict[str, Any]:
        """A copy of `body` carrying the memory block; `body` is never changed."""
        ...

    def first_placement(self, body: dict[str, Any], placement: str) -> str:
        """Where a conversation's first block goes under stable injection (it stays there):
        where the flags say."""
        return placement

    def place(self, body: dict[str, Any], placed: Sequence[Placed]) -> dict[str, Any]:
        """A copy of `body` carrying each block at its place (the user messages counted as
        in `conversation`); `body` is never changed."""
        ...

    def conversation(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The body's conversation as chat messages (text only)."""
        ...

    def compaction_shape(self, body: dict[str, Any]) -> Shape | None:
        """The conversation's items for compaction (None: this body cannot be compacted)."""
        ...

    def compacted(self, body: dict[str, Any], span: tuple[int, int], summary: str) -> dict[str, Any]:
        """A copy of `body` whose items in `span` are replaced by one carrying `summary`."""
        items, (start, end) = body[self.items_field], span
        return {**body, self.items_field: [*items[:start], self.summary_item(summary), *items[end:]]}

    def summary_item(self, summary: str) -> dict[str, Any]:
        """The item that carries a compaction's summary: a system message."""
        return {"role": "system", "content": summary}

    def read_reply(self, body: dict[str, Any]) -> Reply:
        """What a whole successful reply said."""
        ...

    def usage_tap(self, *, strip: bool) -> UsageTap:
        """A reader of this format's stream for its usage (`strip`: take out the usage
        chunk memproxy asked for)."""
        return UsageTap(self.read_usage, self.usage_mark, strip=strip)

    def error_response(self, error: ProxyError) -> Response:
        """An error before the reply started, in this format's envelope (OpenAI's unless the
        format has its own)."""
        return error.to_response()

    def error_event(self, error: ProxyError, last_sent: bytes) -> bytes:
        """The one SSE event that ends a stream which already started; `last_sent` is the
        last chunk relayed (a format may number its events)."""
        ...

    async def open_litellm(
        self, target: Target, body: dict[str, Any], *, timeout: float,
        trace: Mapping[str, str] | None = None,
    ) -> UpstreamReply:
        """Send through litellm (with `trace`, memproxy's Trace Context headers), only the
        format's own parameters; the reply in this format's wire shape."""
        from proxy.upstream.litellm_transport import OPENERS  # litellm loads on first use

        return await OPENERS[self.route](target, body, self.params, timeout=timeout, trace=trace)


@dataclass
class TextParts:
    """A reply's text pieces and tool calls, gathered by a tee."""

    parts: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def text(self) -> str:
        """Content first, then each tool call on its own line."""
        return "\n".join(filter(None, ["".join(self.parts), *self.calls]))


@dataclass
class EventTee(ABC):
    """A reader of a stream whose every event is a JSON object (Messages, Responses): the
    reply's text pieces and tool calls, and whether it ended complete."""

    decoder: SSEDecoder = field(default_factory=SSEDecoder)
    gathered: TextParts = field(default_factory=TextParts)
    reply_id: str | None = None
    finished: bool = False
    malformed: bool = False
    skip: ClassVar[str | None] = None  # data that is not an event (the Responses API's [DONE])

    def feed(self, chunk: bytes) -> None:
        """Take relayed bytes."""
        for event in self.decoder.feed(chunk):
            if self.malformed or (self.skip is not None and event.data.startswith(self.skip)):
                continue
            payload = event_payload(event)
            if payload is None:
                self.malformed = bool(event.data)
            else:
                self._read(payload)

    @abstractmethod
    def _read(self, payload: dict[str, Any]) -> None:
        """One event's data."""


def as_dict(value: Any) -> dict[str, Any]:
    """`value` when it is an object, else an empty one: any field may hold any type."""
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    """`value` when it is an array, else an empty one."""
    return value if isinstance(value, list) else []


def tool_call_line(name: Any, arguments: Any) -> str:
    """A tool call as memory stores it (the chat format's rendering)."""
    return f"[tool call] {name if isinstance(name, str) else ''}({arguments if isinstance(arguments, str) else ''})"
