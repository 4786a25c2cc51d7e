"""Memory around one request of any format: recall before forwarding, remember after the reply.

Memory never breaks the chat: every failure here is caught, counted, and reported in the
`X-Memory-Error` response header while the request goes through.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from config import Flags
from memory import (
    Injection,
    Placed,
    Recalled,
    RecallRequest,
    ReplyChain,
    RequestMetrics,
    Spooled,
    SpoolRecall,
    UnsavedStamp,
    organization_memory,
)
from proxy.access.identity import presented_key, proxy_key_sent
from proxy.flow.call import Call
from proxy.http.errors import MemoryUnavailable
from proxy.http.logs import get_logger
from proxy.state import AppState
from proxy.upstream.client import Target
from proxy.upstream.llm_client import learning_route

log = get_logger("memory")
# How long a reply waits, at most, for its request's turns to be committed before it starts.
STORE_WAIT_SECONDS = 2.0


class MemoryStep:
    """The recall and remember steps of one request.

    `messages` is the request's conversation as chat messages. For a request that sends only
    its new messages and names the reply it continues (`previous_response_id`), `chain` is
    the stored conversation before them: it becomes `context` (recall reads it; it is not
    stored again), and the stored reply's turn id `after` (the new turns go on from it).

    `route`: how this conversation reaches its model (`proxy.upstream.llm_client.learning_route`),
    recorded with its learning jobs so they ask the model the same way.

    `stable` (stable injection, docs/memory.md): the blocks earlier requests of the session
    injected go back at their places (`placed`), and this request's block holds only the
    items they do not show; it is kept with the request's last user turn. The first block
    of a conversation goes where `first_placement` says, the others before their turn.
    """

    def __init__(self, state: AppState, call: Call, chain: ReplyChain | None, flags: Flags) -> None:
        self.state = state
        self.identity = call.identity
        self.flags = flags
        self.request_id = call.request_id
        self.model: str = call.body["model"]
        self.messages = call.parsed.conversation
        self.context: Sequence[Mapping[str, Any]] = ()
        self.after: int | None = None
        # A session named in a header may differ from the chain's: then the turns start there.
        if chain is not None and chain.session_id == call.identity.session_id:
            self.context = [
                {"role": t.role, "content": t.content, "name": t.name} for t in chain.turns
            ]
            self.after = chain.last_turn_id
        self.errors: list[str] = []
        self.recalled: Recalled | None = None
        # Stable injection needs the whole conversation in the request, as sent: not with a
        # stored chain before it, nor when compaction may rewrite it.
        self.stable = flags.injection == "stable" and chain is None and not flags.compact
        self.first_placement = call.fmt.first_placement(call.body, flags.placement)
        self.route = learning_route(call.target)  # the way in its learning jobs take
        self._users = [i for i, m in enumerate(self.messages) if m.get("role") == "user"]
        # Stable injection: every block of the request at its place (None: fresh injection).
        self.placed: list[Placed] | None = None
        # Writing off: the session's blocks live in this process (memory.recall.unsaved_blocks);
        # the stamp its new block is kept with.
        self._unsaved: UnsavedStamp | None = None
        self._injected: tuple[int, Injection] | None = None  # this request's new block
        self._stored: asyncio.Task[int | Spooled | None] | None = None
        self._reply: asyncio.Task[None] | None = None

    @property
    def writing(self) -> bool:
        """Whether this request's turns are remembered."""
        return self.flags.write and not self.flags.dry_run and self.state.memory is not None

    async def recall(self) -> Recalled | None:
        """Recalled memory for this request, or None when reading is off or failed."""
        memory = self.state.memory
        if memory is None or not (self.flags.read or self.flags.dry_run):
            return None
        started = time.perf_counter()
        try:
            placed = await self._placed_blocks()
            last = len(self._users) - 1  # a retry recalls as its first try: not its own block
            self.recalled = await memory.cached_recall(RecallRequest(
                self.identity.user_id, self.identity.session_id,
                [*self.context, *self.messages], self.model, self.flags.budget, self.flags.scope,
                org_id=self.identity.org_id,
                shown=frozenset(k for user, b in placed.items() if user < last for k in b.items),
                add_budget=round(self.flags.budget * self.state.settings.memory_stable_share),
                relevance=self.state.settings.memory_delta_relevance,
                similarity=self.state.settings.memory_delta_similarity,
                rerank=self.flags.rerank,
            ))
            if self.placed is not None:
                self._place(placed, self.recalled)
                self._keep_unsaved()
        except SpoolRecall as partial:
            # The database is unreachable: the block holds the session's spooled turns
            # (memory.recall.spooled), and the outage is still reported.
            self.recalled = partial.recalled
            if self.placed is not None:
                self._place(placed, self.recalled)
            self.failed("recall", partial.__cause__ or partial)
        except Exception as exc:
            self.failed("recall", exc)
            self.placed = None
        metrics = self.state.metrics
        metrics.recall_latency.observe(time.perf_counter() - started)
        if self.recalled is not None:
            metrics.injected_tokens.observe(self.recalled.tokens)
            if self.state.settings.recall_cache_entries and self.recalled.skipped is None:
                (metrics.recall_cache_hits if self.recalled.cached else metrics.recall_cache_misses).inc()
            self._reranked(self.recalled)
        return self.recalled

    def _reranked(self, recalled: Recalled) -> None:
        """Count the rerank stage, and report a fallback to the fused order."""
        report = recalled.rerank
        if report is None or recalled.cached:
            return
        metrics = self.state.metrics
        metrics.rerank_latency.observe(report.ms / 1000)
        if report.fallback is not None:
            metrics.rerank_fallbacks.labels(report.fallback).inc()
            self.errors.append(f"rerank: {report.fallback}")

    async def _placed_blocks(self) -> dict[int, Injection]:
        """Stable injection: {user message number: block} of the blocks earlier requests
        placed in this conversation, its last user message included."""
        memory = self.state.memory
        if memory is None or not self.stable or not self._users:
            return {}
        self.placed = []
        if not self.flags.write and self.state.settings.unsaved_blocks_entries:
            org = self.identity.org_id if self.flags.scope == "organization" else None
            found, self._unsaved = await memory.unsaved_blocks(
                self.identity.user_id, self.identity.session_id, self.messages,
                org_memory=organization_memory(org) if org else None,
            )
        else:
            found = await memory.placed_blocks(
                self.identity.user_id, self.identity.session_id, self.messages, after=self.after
            )
        return {self._users.index(i): block for i, block in found.items() if i in self._users}

    def _place(self, placed: dict[int, Injection], recalled: Recalled) -> None:
        """Every block at its place: the earlier ones, then this request's at its last user
        message (for a retry, the block its first try kept, byte for byte)."""
        last = len(self._users) - 1
        own = placed.get(last)
        if own is None and recalled.items:
            # Into the system prompt only as the conversation's first block: appended later,
            # it would change the prompt's start and lose the whole cached prefix.
            placement = self.first_placement if last == 0 else "last_user"
            own = Injection(placement, recalled.block, [item.id for item in recalled.items],
                            recalled.tokens)
            self._injected = (self._users[last], own)
        self.placed = [Placed(user, b.block, b.placement) for user, b in sorted(placed.items())
                       if user != last]
        if own is not None:
            self.placed.append(Placed(last, own.block, own.placement))

    def _keep_unsaved(self) -> None:
        """Writing off: keep this request's new block in the process (not for a dry run,
        whose block goes nowhere)."""
        memory = self.state.memory
        if memory is None or self._unsaved is None or self._injected is None or self.flags.dry_run:
            return
        index, injection = self._injected
        memory.unsaved.keep(self.identity.user_id, self.identity.session_id, self.messages,
                            index, injection, self._unsaved)

    def lend_client_key(self, headers: Mapping[str, str], target: Target) -> None:
        """Bring-your-own-key: this user's learning jobs may use the key the client sent to
        `target` (in memory only, and only for that upstream)."""
        llm = self.state.llm
        # A route's configured key wins over a lent one, so lending to it is harmless.
        if llm is None or not self.writing or proxy_key_sent(headers, self.state.settings):
            return  # a memproxy key is never lent: it is no upstream's
        key = presented_key(headers)
        if key:
            llm.lend_key(self.identity.user_id, target, key)

    def check_room(self) -> None:
        """Refuse (503, before anything is forwarded) while the database is unreachable and
        the local spool holds its bound of turns, or this user's share of them: answered, the
        request's turns would be lost."""
        memory = self.state.memory
        if memory is None or not self.writing or not memory.spool_full(self.identity.user_id):
            return
        raise MemoryUnavailable(
            "memory's database is unreachable and this replica's spool is full for this "
            f"user ({memory.spool_status()[0]} turns waiting; MEMPROXY_SPOOL_MAX_TURNS, "
            "MEMPROXY_SPOOL_MAX_TURNS_PER_USER): the conversation cannot be remembered "
            "now; retry later, or send X-Memory-Write: off to chat without remembering"
        )

    def start_remembering(self) -> None:
        """Store the request's turns in the background, once the upstream has answered.

        Only an exchange that completed is remembered (docs/api-formats.md, "Errors and
        retries"): a request the upstream refused or never answered would leave a question
        without its answer, which later recalls would bring back; the client's retry resends
        it anyway. A stream counts from its first byte, so one cut midway keeps its user
        turn. A second call does nothing.
        """
        memory = self.state.memory
        if memory is None or not self.writing or self._stored is not None:
            return
        self._stored = self.state.spawn(memory.remember_request(
            self.identity.user_id, self.identity.session_id, self.messages,
            model=self.model, request_id=self.request_id, after=self.after,
            injected=self._injected,
        ))

    async def stored(self, timeout: float = STORE_WAIT_SECONDS) -> None:
        """Wait up to `timeout` seconds for the request's turns to be committed; never raises.

        The write starts once the upstream answered and takes a few milliseconds. Once it is
        committed, a crash in the middle of a stream cannot lose a turn the client saw
        accepted, and a storage failure can still go out in X-Memory-Error.
        """
        if self._stored is not None and not self._stored.done():
            await asyncio.wait({self._stored}, timeout=timeout)

    async def answered_turn(self) -> int | None:
        """The id of the last reply the request's history holds, storing its conversation up
        to there now (each turn once): compaction summarises that history before the
        upstream has answered this request's new messages (proxy/flow/compaction.py)."""
        memory = self.state.memory
        replies = [i for i, m in enumerate(self.messages) if m.get("role") == "assistant"]
        if memory is None or not self.writing or not replies:
            return None
        stored = await memory.remember_request(
            self.identity.user_id, self.identity.session_id, self.messages[: replies[-1] + 1],
            model=self.model, request_id=self.request_id, after=self.after,
        )
        return stored if isinstance(stored, int) else None  # spooled: no id yet

    def remember_reply(
        self, text: str | None, *, incomplete: bool, reply_id: str | None = None
    ) -> None:
        """Store the assistant's reply once the request's turns are in, then the metrics row.

        `reply_id`: the upstream's id for the reply (a Responses API response id), stored
        as the reply turn's request id so a request continuing from it finds it.
        """
        if self.state.memory is None or not self.flags.active or self._reply is not None:
            return  # once: a stream may store its reply before it ends
        self._reply = self.state.spawn(self._after_reply(text, incomplete, reply_id or self.request_id))

    async def reply_stored(self, timeout: float = STORE_WAIT_SECONDS) -> None:
        """Wait up to `timeout` seconds for the reply to be committed; never raises.

        A client that continues from a reply by its id (`previous_response_id`) may send
        that request the moment it has the reply: the reply must be findable by then.
        """
        if self._reply is not None and not self._reply.done():
            await asyncio.wait({self._reply}, timeout=timeout)

    async def _after_reply(self, text: str | None, incomplete: bool, reply_id: str) -> None:
        memory = self.state.memory
        assert memory is not None
        try:
            after = await self._stored if self._stored is not None else None
            if self._stored is not None and text:
                await memory.remember_reply(
                    self.identity.user_id, self.identity.session_id, after, text,
                    model=self.model, request_id=reply_id, incomplete=incomplete,
                    route=self.route,
                )
        except Exception as exc:
            self.failed("remember", exc)
        try:
            await memory.record(self._metrics_row())
        except Exception as exc:
            self.failed("metrics", exc)

    def headers(self) -> dict[str, str]:
        """X-Memory-* response headers describing what memory did."""
        headers: dict[str, str] = {}
        if self.recalled is not None:
            headers["X-Memory-Injected-Tokens"] = str(self.recalled.tokens)
            headers["X-Memory-Items"] = str(len(self.recalled.items))
            headers["X-Memory-Recall-Ms"] = f"{self.recalled.recall_ms:.1f}"
        if self._stored is not None and self._stored.done() and self._stored.exception():
            self.failed("remember", self._stored.exception())  # type: ignore[arg-type]
        if self.errors:
            headers["X-Memory-Error"] = "; ".join(self.errors)[:500]
        return headers

    def failed(self, stage: str, exc: BaseException) -> None:
        """Record a memory failure: counted, logged, and reported in X-Memory-Error."""
        reason = f"{stage}: {type(exc).__name__}"
        if reason not in self.errors:
            self.errors.append(reason)
            self.state.metrics.memory_errors.labels(stage).inc()
            log.warning("memory degraded", extra={
                "stage": stage, "error": type(exc).__name__, "detail": str(exc)[:200],
                "request_id": self.request_id,
            })

    def _metrics_row(self) -> RequestMetrics:
        recalled = self.recalled
        return RequestMetrics(
            created_at=time.time(), user_id=self.identity.user_id,
            # Writing off: nothing of the session is stored, its id and request ids neither.
            session_id=self.identity.session_id if self.flags.write else "",
            request_id=self.request_id if self.flags.write else "", model=self.model,
            items=Counter(item.source for item in recalled.items) if recalled else {},
            injected_tokens=recalled.tokens if recalled else 0,
            truncated=bool(recalled and recalled.truncated),
            recall_ms=recalled.recall_ms if recalled else None,
            embed_ms=recalled.embed_ms if recalled else None,
            error="; ".join(self.errors) or None,
        )
