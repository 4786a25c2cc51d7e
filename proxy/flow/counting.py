"""A reply's tokens in its call's tally (docs/usage.md, "When the usage never comes"): the
upstream's own counts where they came, else what memproxy saw pass, the prompt it sent and
the text it relayed, with the model's tokenizer (proxy/access/quota.py)."""

from __future__ import annotations

from collections.abc import Callable

from proxy.access.quota import KeptReply, prompt_tokens, text_tokens
from proxy.flow.call import Call
from proxy.formats.base import ApiFormat
from proxy.http.sse import ReplyTee, json_object


def count_reply(
    call: Call, input_tokens: int | None, output_tokens: int | None, *,
    relayed: Callable[[], str], scale: Callable[[int], int] = lambda n: n, cut: bool = False,
) -> None:
    """A reply's tokens in the call's tally: the upstream's own counts, and where one never
    came (a stream cut before its usage, an upstream that sends none) what memproxy saw
    pass: the prompt it sent and the text it relayed, with the model's tokenizer. A `cut`
    stream's output is at least its relayed text: a count sent before the text (Messages'
    `message_start` says 1) is not its end."""
    model = str(call.body["model"])
    if input_tokens is None:
        input_tokens = prompt_tokens(call.sent, model, raw_size=call.sent_size)
    if output_tokens is None or cut:
        output_tokens = max(output_tokens or 0, scale(text_tokens(relayed(), model)))
    call.tally.input_tokens, call.tally.output_tokens = input_tokens, output_tokens


def count_error(call: Call, content: bytes) -> None:
    """An upstream error's tokens, when its body says it spent some (a failed response)."""
    payload = json_object(content)
    seen = call.fmt.read_usage(payload) if payload is not None else None
    if seen is not None:
        call.tally.input_tokens = seen.input_tokens or 0
        call.tally.output_tokens = seen.output_tokens or 0


def kept_text(fmt: ApiFormat, kept: KeptReply, tee: ReplyTee | None) -> str:
    """The text of a relayed stream: its tee's when it had one, else read from the bytes
    kept (a rare path: only for a stream whose usage never came)."""
    if tee is None:
        tee = fmt.tee()
        for part in kept.parts:
            tee.feed(part)
    return tee.text
