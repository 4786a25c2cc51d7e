"""POST /v1/memory/search: exactly what would be injected for a query, with scores and sources.

It runs the same recall a chat request runs (a synthetic one-message conversation), so the
block, items and token count are what the model would see; no model is called. Without the
embedding model (the degraded mode /readyz reports) there is nothing to search with: a 503
that says so, where a chat goes through without memory (docs/memory-api.md).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from config.choices import MAX_BUDGET, SCOPES
from memory import EmbeddingModelMissing, MemoryEngine, Recalled, RecallRequest
from proxy.access.identity import MAX_ID_LENGTH
from proxy.http.errors import InvalidRequest, MemoryUnavailable
from proxy.management.access import Caller, endpoint, respond
from proxy.management.inputs import choice, json_object, number, text

DEFAULT_MODEL = "gpt-4o"
MAX_QUERY_CHARS = 8000


@endpoint
async def search(request: Request, who: Caller) -> Response:
    """What recall injects for `query` within `budget` and `scope`."""
    body = await json_object(
        request, who.settings.max_body_bytes, ("query", "budget", "scope", "session_id", "model")
    )
    query = text(body, "query", required=True, max_chars=MAX_QUERY_CHARS) or ""
    budget = number(body, "budget", low=0, high=MAX_BUDGET, integer=True)
    scope = choice(body, "scope", SCOPES) or who.settings.memory_scope
    session_id = text(body, "session_id", max_chars=MAX_ID_LENGTH)
    if scope == "session" and session_id is None:
        raise InvalidRequest("scope session needs a session_id", param="session_id")
    model = text(body, "model", max_chars=200) or DEFAULT_MODEL
    budget = who.settings.memory_budget if budget is None else budget
    recalled = await searched(who.memory, RecallRequest(
        who.user_id, session_id or "", [{"role": "user", "content": query}], model, budget, scope,
        None if who.shared else who.org_id,
    ))
    return respond({
        "object": "memory.search", "query": query, "user_id": who.user_id,
        "session_id": session_id, "scope": scope, "budget": budget, "model": model,
        **recalled.as_dict(),
    })


async def searched(memory: MemoryEngine, request: RecallRequest) -> Recalled:
    """Recall for a search (this route, MCP's search_memory); MemoryUnavailable (503) when
    the embedding model is missing, with what /readyz says and the fix."""
    try:
        return await memory.recall(request)
    except EmbeddingModelMissing as exc:
        detail = str(exc).removeprefix("the embedding model is unavailable: ")
        raise MemoryUnavailable(
            f"memory search needs the embedding model, which is unavailable: {detail}."
            " /readyz reports it under \"embeddings\"; chats go on without memory until"
            " MEMPROXY_EMBEDDING_MODEL_DIR names a folder holding the model and memproxy"
            " restarts"
        ) from exc
