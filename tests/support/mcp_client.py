"""The official `mcp` SDK's client against memproxy's /mcp on a real socket, for tests:

    async with mcp_session(proxy, key="key-alice-0001") as client:
        result = await client.call_tool("search_memory", {"query": "editor"})
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, Implementation

from tests.support.chat import Served

Mode = Literal["auto", "legacy"]


@contextlib.asynccontextmanager
async def mcp_session(
    proxy: Served | str, *, key: str | None = None, mode: Mode = "auto",
    headers: Mapping[str, str] | None = None, name: str | None = None,
) -> AsyncIterator[Client]:
    """A connected client: `mode` "auto" speaks the newest protocol (2026-07-28, one
    self-contained request each), "legacy" the initialize handshake (2025-11-25); `name` is
    the client's name in its client info (the SDK's own when None)."""
    url = proxy if isinstance(proxy, str) else proxy.base_url.removesuffix("/v1")
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    async with (
        httpx2.AsyncClient(headers=sent, timeout=60) as http,
        Client(
            streamable_http_client(f"{url}/mcp", http_client=http), mode=mode,
            client_info=None if name is None else Implementation(name=name, version="1"),
        ) as client,
    ):
        yield client


def structured(result: CallToolResult) -> dict[str, Any]:
    """The structured content of a successful call."""
    assert not result.is_error, result.content
    content = result.structured_content
    assert isinstance(content, dict)
    return content


def error_text(result: CallToolResult) -> str:
    """The message of a call that ended in an error."""
    assert result.is_error, result.structured_content
    return " ".join(getattr(block, "text", "") for block in result.content)
