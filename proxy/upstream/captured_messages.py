"""Message text handed to a span attribute, redacted (docs/tracing.md, message contents).

This is the one place conversation text reaches a span: the GenAI span's
`gen_ai.input.messages` and `gen_ai.output.messages` are made here, and every string in a
message's content is redacted as stored turns are (memory/redact.py), each on its own before
it is encoded, so JSON escaping cannot split a secret from the pattern that finds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson


def captured_messages(messages: Sequence[Mapping[str, Any]], redact: Callable[[str], str]) -> str:
    """Messages in the GenAI conventions' shape (role and text parts), each text redacted."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            text = redact(content)
        elif content is None:
            text = ""
        else:  # parts, tool calls: every string inside redacted, then the whole as JSON
            text = orjson.dumps(_redacted(content, redact)).decode()
        out.append({"role": str(message.get("role", "")),
                    "parts": [{"type": "text", "content": text}]})
    return orjson.dumps(out).decode()


def _redacted(value: Any, redact: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {key: _redacted(item, redact) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(item, redact) for item in value]
    return value
