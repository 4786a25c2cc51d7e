"""Settings of memory: storage, the per-request defaults, embeddings, recall."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from config.choices import INJECTIONS, MODES, PLACEMENTS, SCOPES
from config.fields import default_data_dir, setting, setting_factory
from config.sections.serving import ServingSettings


@dataclass(frozen=True)
class MemorySettings(ServingSettings):
    """Storage, memory defaults, embeddings and recall."""

    # -- storage
    data_dir: Path = setting_factory(
        default_data_dir, "Where the database and the vector index live."
    )
    database_url: str | None = setting(
        None,
        "PostgreSQL that holds turns, facts, summaries, profiles, jobs and full-text search "
        "for any number of replicas, such as postgresql://memproxy:secret@db:5432/memproxy. "
        "Unset: the embedded SQLite file under data_dir.",
        secret=True,  # its password
    )
    chroma_url: str | None = setting(
        None,
        "Address of a Chroma server (`chroma run`) that holds the vectors, such as "
        "http://chroma:8000. Unset: embedded Chroma under data_dir.",
    )
    redact: str = setting(
        "secrets",
        "Replace secrets with a typed placeholder such as [REDACTED:api_key] before a turn, "
        "fact or summary is stored: secrets (API keys, Stripe, Hugging Face, GitHub and "
        "GitLab tokens, JWTs, bearer and Basic credentials, AWS key ids and secret keys, "
        "private key blocks, passwords and secret/token assignments; docs/memory.md has the "
        "table), secrets,cards (also Luhn-valid card numbers) or off. The upstream always "
        "gets the original text.",
        choices=("secrets", "secrets,cards", "off"),
    )

    # -- memory defaults (each overridable per request by an X-Memory* header)
    memory: bool = setting(True, "Master switch for memory (X-Memory).")
    memory_read: bool = setting(True, "Recall and inject memory (X-Memory-Read).")
    memory_write: bool = setting(True, "Log turns and learn from them (X-Memory-Write).")
    memory_budget: int = setting(
        1000, "Token budget of the injected memory block (X-Memory-Budget).", min=0, max=100_000
    )
    memory_scope: str = setting(
        "organization",
        "Widest scope recall may use: session, user, or organization (the user's memory, "
        "then what the user's organisation shares) (X-Memory-Scope).",
        choices=SCOPES,
    )
    org_budget_share: float = setting(
        0.25,
        "Share of the memory budget kept for an organisation's shared facts when some are "
        "relevant; the rest of the budget is the user's, and either takes what the other "
        "leaves.", min=0.0, max=1.0,
    )
    memory_placement: str = setting(
        "system",
        "Where the memory block goes: system (the system prompt) or last_user (a system "
        "message right before the last user message; keeps the prefix cacheable) "
        "(X-Memory-Placement).",
        choices=PLACEMENTS,
    )
    memory_mode: str = setting(
        "inject",
        "How the model gets memory: inject (the recalled block goes into the prompt) or tool "
        "(a small pre-fetched block, plus a memory_search tool the proxy answers itself) "
        "(X-Memory-Mode).",
        choices=MODES,
    )
    memory_tool_rounds: int = setting(
        3, "Most rounds of memory_search calls the proxy answers in one request (mode tool; up "
        "to 4 parallel calls a round); after them the tool is no longer offered.", min=1, max=10,
    )
    memory_tool_prefetch: int = setting(
        200, "Token budget of the block pre-fetched into the prompt in mode tool (at most "
        "memory_budget; each memory_search answer gets memory_budget).", min=0, max=100_000,
    )
    memory_injection: str = setting(
        "stable",
        "stable: within a session every earlier memory block goes back where it was, byte for "
        "byte, and a request adds only items not shown yet, so provider prompt caches keep "
        "hitting; fresh: each request gets one newly recalled block (X-Memory-Injection).",
        choices=INJECTIONS,
    )
    memory_stable_share: float = setting(
        0.25,
        "Stable injection: at most this share of the budget goes to new items once earlier "
        "blocks of its session are in a request's prompt (the most relevant of those that "
        "clear memory_delta_relevance); the session's first block gets the whole budget. "
        "1: no limit.",
        min=0.0, max=1.0,
    )
    memory_delta_relevance: float = setting(
        0.2,
        "Stable injection: a later block of a session carries a new item only when its fused "
        "score is at least this share of the highest score the ranking weights allow, and "
        "is left out when no new item does (the default was chosen by "
        "leave-one-conversation-out, docs/benchmarks.md). 0: every new item that fits.",
        min=0.0, max=1.0,
    )
    memory_delta_similarity: float = setting(
        0.3,
        "Stable injection: a later block of a session is added only when the new item most "
        "similar to the request by meaning has at least this raw cosine similarity to it "
        "(the embedding model's scale, the same for every query); below it, nothing new "
        "matters and no block is added (chosen with memory_delta_relevance, "
        "docs/benchmarks.md). 0: no such gate.",
        min=0.0, max=1.0,
    )
    compact: bool = setting(
        False,
        "Compact a conversation that, with its memory block, would pass compact_at of the "
        "model's context window: its middle is replaced by the session's summary "
        "(X-Memory-Compact). Off: such a request goes through unchanged.",
    )
    compact_at: float = setting(
        0.8, "Share of the model's context window at which compaction starts.", min=0.05, max=1.0
    )
    compact_keep_last: int = setting(
        8, "Messages at the end of the conversation that compaction always keeps.", min=1
    )

    # -- embeddings and indexing
    embedding_model_dir: Path | None = setting(
        None,
        "Folder of the all-MiniLM-L6-v2 ONNX model (holding onnx/). Unset: chromadb's "
        "cache path, else a checked download where internet exists.",
    )
    embedding_backend: str = setting(
        "local",
        "local (ONNX on this machine) or upstream (an OpenAI-compatible /embeddings endpoint).",
        choices=("local", "upstream"),
    )
    embedding_upstream_model: str = setting(
        "text-embedding-3-small", "Model name used when embedding_backend is upstream."
    )
    embedding_threads: int = setting(
        2, "CPU threads one local embedding may use. Index jobs embed one at a time, so "
        "indexing never takes more; a query's embedding runs beside them.", min=1, max=64
    )
    embedding_precision: str = setting(
        "float32", "Weights of the local model: float32 (the shipped model) or int8 (a copy "
        "quantized at the first start into data_dir/models and checked against it; about half "
        "the CPU a text). Each has its own collection: switching re-indexes from the database.",
        choices=("float32", "int8"),
    )
    index_batch_jobs: int = setting(
        32, "Index jobs that are ready together run as one, in one embedding batch (a chat "
        "request queues one job for its new turns); 1 runs each alone.", min=1, max=1024,
    )
    chunk_max_tokens: int = setting(
        200, "Largest chunk a turn is split into for indexing, in tokens.", min=16, max=2000
    )
    index_max_chunks_per_turn: int = setting(
        100, "Most chunks one turn is indexed as (searched by meaning and by words): a longer "
        "turn is indexed from its start and stored whole, so one huge message cannot occupy "
        "the shared index queue for minutes. 0: no limit.", min=0,
    )

    # -- recall and ranking
    recall_cache_entries: int = setting(
        1024,
        "Recall results kept for retried and regenerated requests (same user, session, "
        "messages and settings); any write to the user's memory invalidates theirs. 0: off.",
        min=0,
    )
    unsaved_blocks_entries: int = setting(
        4096,
        "Stable injection with writing off (X-Memory-Write: off): the memory blocks of such "
        "sessions kept in this process (never stored), so later requests put them back byte "
        "for byte. 0: off (each such request gets a fresh block).",
        min=0,
    )
    unsaved_blocks_mb: int = setting(
        32, "Most megabytes those kept blocks may take; the least recently used go first.",
        min=1,
    )
    recall_candidates: int = setting(
        60, "Candidates taken from each of dense and lexical search before fusion.", min=1
    )
    recall_excerpt_tokens: int = setting(
        80, "A recalled item longer than this (in tokens, about) is shown as an excerpt: the "
        "run of its sentences that holds the most of the question's words; a neighbour that "
        "matched nothing itself gets half, from its start. 0: items are shown whole.", min=0,
    )
    recall_standing_similarity: float = setting(
        0.2, "Least raw cosine similarity to the question at which one of the user's standing "
        "statements (an instruction or preference stated once: \"Always ...\", \"Never ...\", "
        "\"I prefer ...\") is recalled and lifted by weight_standing.", min=0.0, max=1.0,
    )
    query_split_names: bool = setting(
        True, "Embed the recall query without the names of the people the user's turns were "
        "said under, adding each name it says back at query_name_weight (turns are embedded "
        "with their speaker's name, which otherwise outweighs a short question's topic).",
    )
    query_name_weight: float = setting(
        0.3, "Weight of each speaker's name vector added to the query's vector when "
        "query_split_names is on (0: the names are left out).", min=0.0,
    )
    query_embed_words: int = setting(
        32, "Longest query, in words, that recall embeds; a longer one keeps its first quarter "
        "and last three quarters (the lexical search still uses every word). 0: no limit.",
        min=0,
    )
    vector_cache_mb: int = setting(
        512, "Memory for the copies of users' vectors that recall searches exactly (least "
        "recently used dropped first; the latest user always stays); 0 queries Chroma with a "
        "metadata filter instead.", min=0,
    )
    weight_dense: float = setting(
        1.0, "Fusion weight of dense (vector) similarity, min-max scaled over a query's "
        "candidates; 0 skips the vector search.", min=0.0,
    )
    weight_bm25: float = setting(
        1.5, "Fusion weight of BM25 (lexical) relevance over a turn's text and speaker, min-max "
        "scaled over a query's candidates; 0 skips the lexical search.", min=0.0,
    )
    weight_identifier: float = setting(
        0.5, "Fusion weight of an exact code-identifier match.", min=0.0
    )
    weight_recency: float = setting(0.1, "Fusion weight of recency.", min=0.0)
    weight_session: float = setting(
        0.1, "Boost for items from the request's own session.", min=0.0
    )
    recency_half_life_days: float = setting(
        30.0, "Age at which the recency signal halves, in days.", min=0.001
    )
    weight_context: float = setting(
        0.4,
        "Share of a top item's score given to the turns just before and after it (an answer "
        "next to a matching question); 0 turns this off.",
        min=0.0,
    )
    weight_conversation: float = setting(
        0.4,
        "Fusion weight of how well an item's whole session matches (the mean of its three "
        "best items, scaled to the best session's); 0 turns this off.",
        min=0.0,
    )
    weight_user: float = setting(
        0.6,
        "Added to the score of the user's own turns (role user, no name) after fusion: with a "
        "model they state the user's facts and plans, which the model's replies only "
        "elaborate on; a later block's relevance cut leaves it out. 0 turns this off.",
        min=0.0,
    )
    weight_standing: float = setting(
        1.0,
        "Added to the score of the user's standing statements that are about the question "
        "(recall_standing_similarity): said once, they hold for every later question on their "
        "subject; a later block's relevance cut leaves it out. 0 turns their search off.",
        min=0.0,
    )
