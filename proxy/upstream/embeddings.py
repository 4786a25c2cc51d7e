"""Embeddings from an OpenAI-compatible /embeddings endpoint instead of the local model.

An upstream that cannot be reached, times out, or whose gateway answers 502/503/504 is an
outage (memory's Unavailable): an index job waits it out without spending its attempts
(memory/jobs/worker.py). Any other error status is the call's own failure and counts.

While tracing, each call is a CLIENT span with the GenAI conventions (operation
`embeddings`, docs/tracing.md), and the upstream gets its `traceparent`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import orjson

from memory import Unavailable
from proxy.http.errors import ProxyError, UpstreamStatus
from proxy.upstream.client import Upstream, is_upstream_outage, raise_for_status, read_body, url_for
from proxy.upstream.genai_span import start
from proxy.upstream.llm_client import scrub

if TYPE_CHECKING:
    from proxy.http.tracing import Tracing


class EmbeddingsUpstreamUnavailable(Unavailable):
    """The embeddings upstream could not be reached, or its gateway said it is down."""

    def __init__(self, detail: str) -> None:
        super().__init__("the embeddings upstream", detail)


class UpstreamEmbedder:
    """Embeds through the default upstream (`MEMPROXY_EMBEDDING_BACKEND=upstream`).

    Background jobs carry no client key, so this needs `MEMPROXY_UPSTREAM_API_KEY` unless
    the upstream is keyless (a local server).
    """

    def __init__(
        self, upstream: Upstream, model: str, *, batch_size: int = 256,
        tracing: Tracing | None = None,
    ) -> None:
        self.upstream = upstream
        self.model = model
        self.batch_size = batch_size
        self.tracing = tracing

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors for `texts`, in order."""
        batches = [
            await self._batch(texts[i : i + self.batch_size])
            for i in range(0, len(texts), self.batch_size)
        ]
        if not batches:
            return np.zeros((0, 0), dtype=np.float32)
        vectors = np.concatenate(batches).astype(np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.where(norms == 0, 1.0, norms)

    async def _batch(self, texts: Sequence[str]) -> np.ndarray:
        target = self.upstream.default
        headers = [("content-type", "application/json")]
        if target.api_key:
            headers.append(("authorization", f"Bearer {target.api_key}"))
        body = orjson.dumps({"model": self.model, "input": list(texts), "encoding_format": "float"})
        call = None if self.tracing is None else start(
            self.tracing, target, {"model": self.model}, provider="openai", operation="embeddings",
        )
        if call is not None and call.headers:
            headers.extend(call.headers.items())
        try:
            response = await self.upstream.open(
                "POST", url_for(target, "/v1/embeddings"), headers, body
            )
            await raise_for_status(response)
            payload = orjson.loads(await read_body(response))
        except BaseException as exc:
            if call is not None:
                call.failed(exc)
            if not isinstance(exc, ProxyError) or not is_upstream_outage(exc):
                raise
            detail = str(exc)
            if isinstance(exc, UpstreamStatus):
                detail = f"HTTP {exc.status}: {exc.body[:300].decode('utf-8', 'replace')}"
            raise EmbeddingsUpstreamUnavailable(scrub(detail, target.api_key)) from None
        if call is not None:
            call.finished(payload if isinstance(payload, dict) else {})
        rows = sorted(payload["data"], key=lambda row: row["index"])
        if len(rows) != len(texts):
            raise ValueError(f"upstream returned {len(rows)} embeddings for {len(texts)} inputs")
        return np.asarray([row["embedding"] for row in rows], dtype=np.float32)
