"""Settings of the rerank stage: a reranker that reorders recall's fused candidates."""

from __future__ import annotations

from dataclasses import dataclass

from config.choices import RERANKERS
from config.fields import setting
from config.sections.learning import LearningSettings


@dataclass(frozen=True)
class RerankSettings(LearningSettings):
    """The rerank stage (docs/memory.md, Rerank)."""

    rerank: str = setting(
        "off",
        "Reorder recall's best fused candidates before packing: off, endpoint (a "
        "Cohere-style POST {rerank_base_url}/rerank: Cohere, Jina, Voyage, TEI, Infinity, "
        "vLLM, LiteLLM) or llm (the learning route's model orders them) (X-Memory-Rerank).",
        choices=RERANKERS,
    )
    rerank_base_url: str | None = setting(
        None,
        "Base URL of the rerank endpoint, such as http://127.0.0.1:8080 for TEI or "
        "https://api.cohere.com/v2; memproxy posts to {rerank_base_url}/rerank. Needed by "
        "rerank endpoint.",
    )
    rerank_model: str | None = setting(
        None,
        "Model the rerank endpoint is asked for (`model`), or, with rerank llm, the model "
        "that orders the candidates. Unset: the endpoint's default; with llm, extract_model "
        "(one of the two is needed).",
    )
    rerank_api_key: str | None = setting(
        None,
        "Bearer key sent to rerank_base_url, and only there. Unset: no Authorization header "
        "(a local reranker).",
        secret=True,
    )
    rerank_format: str = setting(
        "cohere",
        "The rerank endpoint's body: cohere ({model, query, documents, top_n}: Cohere, Jina, "
        "Voyage, Infinity, vLLM, LiteLLM) or tei (text-embeddings-inference: {query, texts}).",
        choices=("cohere", "tei"),
    )
    rerank_candidates: int = setting(
        30,
        "How many of the best fused candidates (facts, summaries and turns together) the "
        "reranker orders; the rest keep their fused order after them.",
        min=1, max=200,
    )
    rerank_timeout_ms: int = setting(
        300,
        "Most milliseconds recall waits for the reranker; past it (or on any error) recall "
        "uses the fused order and says so in X-Memory-Error.",
        min=1, max=60_000,
    )

    def rerank_problem(self) -> str | None:
        """What keeps the rerank settings from working together, if anything."""
        if self.rerank == "endpoint" and not self.rerank_base_url:
            return "rerank: endpoint needs MEMPROXY_RERANK_BASE_URL"
        if self.rerank == "llm" and not (self.rerank_model or self.extract_model):
            return "rerank: llm needs MEMPROXY_RERANK_MODEL (or MEMPROXY_EXTRACT_MODEL)"
        return None
