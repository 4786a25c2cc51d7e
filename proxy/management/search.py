"""POST /v1/memory/search: exactly what would be injected for a query, with scores and sources.

It runs the same recall a chat request runs (a synthetic one-message conversation), so the
block, items and token count are what the model would see; no model is called. Without the
embedding model (the degraded mode /readyz reports) there is nothing to search with: a 503
that says so, where a chat goes through without memory (docs/memory-api.md).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from memory import EmbeddingModelMissing, Recalled, RecallRequest
from proxy.http.errors import InvalidRequest, MemoryUnavailable
from proxy.management.access import Caller, respond
from proxy.management.bodies import SearchQuery
from proxy.management.inputs import json_body
from proxy.management.operations import memory

DEFAULT_MODEL = "gpt-4o"


@memory("POST /search", "What would be injected for a query (no model is called)",
        "SearchResult", "400", "413", body=SearchQuery)
async def search(request: Request, who: Caller) -> Response:
    """What recall injects for `query` within `budget` and `scope`."""
    body = await json_body(request, who.settings.max_body_bytes, SearchQuery)
    model = body.model or DEFAULT_MODEL
    scope, budget, recalled = await searched(
        who, body.query, scope=body.scope, session_id=body.session_id, budget=body.budget,
        model=model,
    )
    return respond({
        "object": "memory.search", "query": body.query, "user_id": who.user_id,
        "session_id": body.session_id, "scope": scope, "budget": budget, "model": model,
        **recalled.as_dict(who.memory.redact),
    })


async def searched(
    who: Caller, query: str, *, scope: str | None, session_id: str | None, budget: int | None,
    model: str,
) -> tuple[str, int, Recalled]:
    """Recall for a search (this route, MCP's search_memory), in the server's scope and
    budget unless given: the scope, the budget and what was recalled. 400 for scope session
    without a session; MemoryUnavailable (503) when the embedding model is missing, with
    what /readyz says and the fix."""
    scope = scope or who.settings.memory_scope
    if scope == "session" and session_id is None:
        raise InvalidRequest("scope session needs a session_id", param="session_id")
    budget = who.settings.memory_budget if budget is None else budget
    request = RecallRequest(
        who.user_id, session_id or "", [{"role": "user", "content": query}], model, budget, scope,
        None if who.shared else who.org_id, rerank=who.settings.rerank != "off",
    )
    try:
        return scope, budget, await who.memory.recall(request)
    except EmbeddingModelMissing as exc:
        detail = str(exc).removeprefix("the embedding model is unavailable: ")
        raise MemoryUnavailable(
            f"memory search needs the embedding model, which is unavailable: {detail}."
            " /readyz reports it under \"embeddings\"; chats go on without memory until"
            " MEMPROXY_EMBEDDING_MODEL_DIR names a folder holding the model and memproxy"
            " restarts"
        ) from exc
