"""Prometheus metrics, one registry per app (no module globals)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """The counters and histograms memproxy exports at /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.requests = counter(
            "memproxy_requests", "Requests handled, by route and status.", ["route", "status"]
        )
        self.latency = histogram(
            "memproxy_request_seconds",
            "Time to response headers (streams: to the first byte), by route.", ["route"],
        )
        self.upstream_errors = counter(
            "memproxy_upstream_errors", "Upstream failures, by kind.", ["kind"]
        )
        self.inflight_streams = gauge("memproxy_inflight_streams", "Streams being relayed now.")
        self.recall_latency = histogram(
            "memproxy_recall_seconds", "Memory recall time per request."
        )
        self.injected_tokens = histogram(
            "memproxy_injected_tokens", "Tokens injected per request.",
            buckets=(0, 50, 100, 250, 500, 1000, 2000, 4000, 8000),
        )
        self.compactions = counter(
            "memproxy_compactions", "Requests whose conversation was compacted, by route.",
            ["route"],
        )
        self.compacted_tokens = counter(
            "memproxy_compacted_tokens", "Conversation tokens compaction took out of requests."
        )
        self.memory_tool_searches = counter(
            "memproxy_memory_tool_searches",
            "memory_search calls memproxy answered (X-Memory-Mode: tool), by outcome: found, "
            "nothing, failed.", ["outcome"],
        )
        self.recall_cache_hits = counter(
            "memproxy_recall_cache_hits",
            "Recalls answered from the recall cache (a retried or regenerated request).",
        )
        self.recall_cache_misses = counter(
            "memproxy_recall_cache_misses", "Recalls the recall cache could not answer."
        )
        self.mcp_calls = counter(
            "memproxy_mcp_tool_calls", "MCP tool calls on /mcp, by tool and outcome: ok, error.",
            ["tool", "outcome"],
        )
        self.spool_turns = gauge(
            "memproxy_spool_turns", "Turns waiting in the local spool for the database to answer."
        )
        self.spool_oldest_seconds = gauge(
            "memproxy_spool_oldest_seconds",
            "How long the oldest spooled turn has waited (0: none waits).",
        )
        self.rerank_latency = histogram(
            "memproxy_rerank_seconds", "Time the rerank stage took, fallbacks included."
        )
        self.rerank_fallbacks = counter(
            "memproxy_rerank_fallbacks",
            "Recalls that kept the fused order although rerank was asked for, by reason: "
            "timeout, unreachable, status, malformed, error, not configured.", ["reason"],
        )
        self.memory_errors = counter(
            "memproxy_memory_errors", "Memory failures the chat went through despite.", ["stage"]
        )

    def observe(self, route: str, status: int, seconds: float) -> None:
        """Count one request."""
        key = (route, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(route, str(status)), self.latency.labels(route)
            )
        children[0].inc()
        children[1].observe(seconds)


async def metrics_endpoint(request: Request) -> Response:
    """GET /metrics in Prometheus' text format."""
    state = request.app.state.memproxy
    metrics: Metrics = state.metrics
    if state.memory is not None:
        depth, age = state.memory.spool_status()
        metrics.spool_turns.set(depth)
        metrics.spool_oldest_seconds.set(age or 0.0)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
