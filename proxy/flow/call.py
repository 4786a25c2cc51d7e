"""The Call: everything one request carries through its steps (docs/architecture.md,
"Request flow")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from config import Flags
from proxy.access.identity import Identity
from proxy.access.limits import StreamSlot
from proxy.access.usage import Tally
from proxy.formats.base import ApiFormat, Parsed
from proxy.upstream.client import Target


@dataclass
class Call:
    """Everything one request carries through its steps."""

    fmt: ApiFormat
    parsed: Parsed
    identity: Identity
    flags: Flags
    target: Target
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)
    slot: StreamSlot | None = None  # the key's stream slot (MEMPROXY_MAX_STREAMS_PER_KEY)
    tally: Tally = field(default_factory=Tally)  # its usage (proxy/access/usage.py)
    # memproxy asked for the stream's usage chunk: the client does not see it
    strip_usage: bool = False
    # The body sent upstream and its size in bytes, counted when a reply has no usage.
    sent: dict[str, Any] = field(default_factory=dict)
    sent_size: int = 0

    @property
    def body(self) -> dict[str, Any]:
        """The request body as the client sent it."""
        return self.parsed.body
