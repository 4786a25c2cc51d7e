"""Settings of the HTTP edge: serving, the upstream, access."""

from __future__ import annotations

from dataclasses import dataclass

from config.fields import setting, setting_factory
from config.routing import ApiKey, Route


@dataclass(frozen=True)
class ServingSettings:
    """Serving, the upstream and access."""

    # -- serving
    host: str = setting("127.0.0.1", "Address `memproxy serve` binds to.")
    port: int = setting(8080, "Port `memproxy serve` listens on.", min=1, max=65535)
    log_level: str = setting(
        "info", "Log level: debug, info, warning or error.",
        choices=("debug", "info", "warning", "error"),
    )
    log_format: str = setting(
        "json", "Log line format: json (one JSON object per line; a request's line carries "
        "its trace_id and span_id while tracing is on, docs/tracing.md) or text (for a "
        "terminal: time, level, logger, message, then key=value fields).",
        choices=("json", "text"),
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024, "Largest request body accepted, in bytes; larger bodies get 413.", min=1
    )
    max_header_bytes: int = setting(
        64 * 1024, "Largest request head (request line and headers), in bytes; a larger one "
        "gets 431 and the connection closes.", min=1024,
    )
    header_timeout_seconds: float = setting(
        10.0, "Seconds a client may take to send a request's headers (from the connection's "
        "start, or the request's first byte); then 408 and the connection closes.", min=0.01,
    )
    body_timeout_seconds: float = setting(
        30.0, "Seconds a request body may send nothing while memproxy waits for it; then 408 "
        "(or the connection closes).", min=0.01,
    )

    # -- upstream
    upstream_base_url: str = setting(
        "https://api.openai.com/v1", "Base URL of the default OpenAI-compatible upstream."
    )
    upstream_api_key: str | None = setting(
        None,
        "API key sent to the default upstream. Unset: the client's own Authorization "
        "header is forwarded (bring-your-own-key).",
        secret=True,
    )
    upstream_timeout: float = setting(
        600.0, "Seconds to wait for the upstream's response headers and between body bytes.",
        min=0.001,
    )
    upstream_connect_timeout: float = setting(
        10.0, "Seconds to wait for a TCP connection to the upstream.", min=0.001
    )
    upstream_max_connections: int = setting(
        512, "Most simultaneous connections to upstreams.", min=1
    )
    upstream_retries: int = setting(
        0,
        "Retries of a chat completion, streamed or not, whose upstream connection failed or "
        "that got 429/502/503/504, with exponential backoff honouring Retry-After up to 4 s; "
        "only before any byte reached the client (0: off).",
        min=0, max=10,
    )
    anthropic_base_url: str | None = setting(
        None,
        "Anthropic-compatible upstream for POST /v1/messages (e.g. https://api.anthropic.com): "
        "requests and replies go through as bytes. Unset: /v1/messages goes to the model's "
        "route through litellm's translation (to the default upstream when no route matches).",
    )
    anthropic_api_key: str | None = setting(
        None,
        "x-api-key sent to anthropic_base_url. Unset: the client's own x-api-key (or "
        "Authorization) is forwarded.",
        secret=True,
    )
    routes: tuple[Route, ...] = setting_factory(
        tuple,
        "Model routing table (TOML `[[routes]]` only): `match` a model name or a prefix "
        "ending in `*`, then `base_url` (+ `api_key`) for an OpenAI-compatible upstream or "
        "`provider` (+ `api_key`, `base_url`) for a litellm provider such as `anthropic`; "
        "`context_window` (tokens) overrides litellm's figure for compaction.",
        env=False,
    )

    # -- access
    api_keys: tuple[ApiKey, ...] = setting_factory(
        tuple,
        "Proxy keys, comma-separated; `key:user` binds a key to a user id, `:org=ORG` puts "
        "it in an organisation and `:org-writer` lets it change that organisation's shared "
        "memory (`key[:user][:org=ORG][:org-writer][:quota=N]`); `:quota=N` gives the key a "
        "monthly token quota (input plus output tokens, UTC months; over it: 429). Each key "
        "must be at least 8 characters (a shorter one stops start-up). When set, a request "
        "without a valid key gets 401.",
        secret=True,
    )
    auth: str = setting(
        "auto",
        "Who must show a key: `keys` requires a valid proxy key (from api_keys or the "
        "database, docs/keys.md) on /v1, /mcp and the memory API even when api_keys is "
        "unset; `auto` requires one when api_keys is set, and otherwise still accepts keys "
        "from the database when they are sent.",
        choices=("auto", "keys"),
    )
    admin_key: str | None = setting(
        None, "Admin key: reaches every user's memory through X-Memory-User-Id.", secret=True
    )
    allowed_hosts: str | None = setting(
        None,
        "Host names memproxy answers under, comma-separated (`*`: any), so a web page whose "
        "name a DNS answer pointed at memproxy (DNS rebinding) gets 400. IP addresses and "
        "localhost always pass. Unset: any name when every request needs a proxy key "
        "(api_keys, or auth=keys), else only localhost, addresses and the host it binds to.",
    )
    management_remote: bool = setting(
        False,
        "Without proxy keys, let clients other than loopback reach memory: the memory API "
        "(/v1/memory), panel data, and recall and remembering in their chats (else their "
        "chats go through with memory off). With keys set, keys decide.",
    )
    shared_account_objects: bool = setting(
        False,
        "With an upstream key, let keys bound to a user or organisation reach the upstream "
        "account's own objects through the pass-through (/v1/files, batches, vector stores, "
        "assistants, ...), which every key holder then shares; off, they get 403 and only "
        "unbound keys reach them (docs/security.md).",
    )
    open_relay: bool = setting(
        False,
        "Let `memproxy serve` start bound beyond loopback with an upstream key and no proxy "
        "keys: anyone who reaches the port then chats on that key. Off, it refuses to start "
        "in that shape (set api_keys, bind 127.0.0.1, or unset the upstream key).",
    )
    trusted_proxies: str | None = setting(
        None,
        "Addresses (comma-separated IPs or networks, `*`: any) of reverse proxies whose "
        "X-Forwarded-For and X-Forwarded-Proto name the client. Unset: no forwarding header "
        "is trusted, and a loopback connection that carries one is not taken as a local "
        "user (it was relayed for someone else).",
    )
    metrics_key: str | None = setting(
        None,
        "Bearer token remote clients show for /metrics and /readyz's details (the admin key "
        "works too; clients on this machine need none). With no key of any kind configured "
        "they are open to anyone who reaches the port.",
        secret=True,
    )
    mcp: bool = setting(
        True,
        "Serve the Model Context Protocol at /mcp (Streamable HTTP, stateless): the memory "
        "tools for MCP clients, under the same keys and access rules as the memory API.",
    )
    clear_undo_seconds: float = setting(
        # 60 s, not 10: long enough to copy the undo command the CLI prints and paste it.
        60.0, "How long a clear-all or a deleted fact can be undone; after it the memory is "
        "deleted for good.",
        min=1.0, max=86400.0,
    )
    rate_limit: int = setting(
        0,
        "Requests per minute each key may send to /v1 (token bucket; 0: off). The key is the "
        "proxy key when keys are set, else the client's bearer key, else the user id, and "
        "without proxy keys the client's address counts too (behind a reverse proxy every "
        "client has its address); over it: 429 with a Retry-After of the seconds until the "
        "next request is allowed. A proxy key's rate holds on every replica together (its "
        "bucket is in the database); other buckets are per replica.",
        min=0,
    )
    rate_limit_burst: int = setting(
        0,
        "Requests a key may send at once before rate_limit paces it (the bucket's size; "
        "0: one minute's worth, rate_limit).",
        min=0,
    )
    usage_flush_seconds: float = setting(
        1.0,
        "How often each process adds its usage counts (requests, tokens, errors per day, key "
        "and user) to the database; a crash loses at most this long's counts.",
        min=0.05, max=60.0,
    )
    usage_stream_options: bool = setting(
        True,
        "Ask the upstream for `stream_options.include_usage` on streamed chat completions "
        "and legacy completions whose client did not (the usage chunk is taken out of what "
        "the client sees), so their tokens are counted as the upstream bills them. Off for an "
        "upstream that rejects stream_options: those streams are then counted by memproxy's "
        "tokenizer (the prompt sent and the text relayed).",
    )
    max_streams_per_key: int = setting(
        64,
        "Streamed replies (chat completions, Responses, Messages) each key may have open at "
        "once, counted like rate_limit (0: no limit); one more gets 429 with Retry-After: 1.",
        min=0,
    )
