"""Learning from conversations: the fact-extraction and summary jobs.

With a new assistant reply, in the transaction that stores it, `Learner.queue_after_reply`
queues an `extract_facts` job every `extract_every` user turns of the session and a
`summarize` job every `summary_every`: a crash cannot keep the reply and lose its learning. The
jobs call a language model given by the caller (`LLM`: the proxy posts a chat completion to
the routed upstream). Each job names the route that served its conversation (`route`: an
opaque name the caller gave, such as "anthropic"), so the model is asked in that route's
format, at its host, under its key policy. An answer that is not valid JSON of the right
shape gets one repair
request quoting the error; if that answer is unusable too the job is buried at once with
both raw answers (never silently "no facts"). The payload holds ids and the model name
and route name only: credentials stay with the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from config import Settings
from memory.index.embeddings import Embed
from memory.index.learned_vectors import fact_metadata
from memory.index.shared_vectors import SharedVectors
from memory.jobs.worker import JobFailed
from memory.learning.fact_rules import MERGE_CONFIDENCE_STEP, Neighbour, decide, grounded_in
from memory.learning.facts import Fact, FactStore
from memory.learning.lifecycle import evict_down_to, facts_lock
from memory.learning.llm_output import (
    MalformedOutput,
    parse_json,
    validate_facts,
    validate_summary,
)
from memory.learning.prompts import extraction_messages, repair_messages, summary_messages
from memory.learning.summaries import SummaryStore, summary_lock
from memory.log.turn_log import TurnLog
from memory.storage import jobs
from memory.storage import turns as turn_rows
from memory.storage.database import Transaction
from memory.tokens import encoding_for_model

EXTRACT_JOB = "extract_facts"
SUMMARY_JOB = "summarize"
CONTEXT_TURNS = 2  # earlier turns shown (not mined) so references resolve
KNOWN_FACTS = 20  # nearest known facts shown, so the model can name the one it updates
NEIGHBOURS = 8
MAX_SUMMARY_TURNS = 80
COUNT_MODEL = "gpt-4"
DEFAULT_ROUTE = "openai"  # jobs queued before routes were recorded went this way
log = logging.getLogger("memproxy.learning")
T = TypeVar("T")


class LLM(Protocol):
    """A chat model: messages in, the reply's text out; raises when the call fails.
    `route` names the way in that served the conversation (DEFAULT_ROUTE when unknown)."""

    async def __call__(
        self, model: str, messages: list[dict[str, Any]], *, user_id: str, route: str
    ) -> str: ...


@dataclass(eq=False)
class Learner:
    """Schedules and runs the learning jobs of every user."""

    settings: Settings
    log: TurnLog
    facts: FactStore
    summaries: SummaryStore
    vectors: SharedVectors
    embed: Embed
    llm: LLM | None = field(default=None, init=False)

    async def queue_after_reply(
        self, tx: Transaction, user_id: str, session_id: str, turn_id: int, model: str,
        route: str = DEFAULT_ROUTE,
    ) -> None:
        """Queue, in the transaction storing the reply `turn_id`, the learning jobs it is
        due for (the caller wakes the worker once it commits)."""
        every_fact, every_summary = self.settings.extract_every, self.settings.summary_every
        if self.llm is None or not (every_fact or every_summary):
            return
        user_turns = await turn_rows.count(tx, user_id, session_id=session_id, role="user")
        payload = {"user_id": user_id, "session_id": session_id, "turn_id": turn_id,
                   "model": self.settings.extract_model or model, "user_turns": user_turns,
                   "route": route}
        for kind, every in ((EXTRACT_JOB, every_fact), (SUMMARY_JOB, every_summary)):
            if every and user_turns and user_turns % every == 0:
                await jobs.enqueue(tx, kind, payload, max_attempts=self.settings.job_max_attempts,
                                   owner=user_id)

    # -- facts

    async def extract(self, payload: dict[str, Any]) -> None:
        """The extract_facts job: ask for facts in the latest user turns, then apply them."""
        user_id, session_id = str(payload["user_id"]), str(payload["session_id"])
        every = max(1, self.settings.extract_every)
        turns = await self.log.path(user_id, int(payload["turn_id"]), 8 * every + 24)
        # New: everything after the reply that closed the exchange `every` replies ago, so
        # several user messages in a row are all mined.
        replies = [i for i, t in enumerate(turns) if t.role == "assistant"]
        first_new = replies[-every - 1] + 1 if len(replies) > every else 0
        if not any(t.role == "user" for t in turns[first_new:]):
            return
        start = max(0, first_new - CONTEXT_TURNS)
        turns = turns[start:]
        new_from = first_new - start
        new_user = {i: t for i, t in enumerate(turns, start=1) if i > new_from and t.role == "user"}
        said = [t.content for t in turns if t.role == "user"]
        assistant = [t.content for t in turns if t.role == "assistant"]
        query = "\n".join(t.content for t in new_user.values())
        known = await self._neighbours(user_id, (await self.embed([query]))[0], KNOWN_FACTS)
        messages = extraction_messages(
            turns, new_from, [{"id": n.id, "fact": n.text, "category": n.category} for n in known]
        )
        items = await self._ask(payload, messages, user_id, validate_facts)
        async with facts_lock(self.facts.db, user_id):
            for item in items:
                if (item.confidence < self.settings.extract_min_confidence
                        or item.importance < self.settings.extract_min_importance):
                    continue
                if item.turns and not any(n in new_user for n in item.turns):
                    continue  # it cites only context or the assistant's messages
                cited = [new_user[n] for n in item.turns if n in new_user] or list(new_user.values())
                if not grounded_in(item.fact, said, assistant):
                    log.info("dropped a fact not grounded in the user's words (job for %s)",
                             session_id)
                    continue
                expires = item.expires or self.facts.default_expiry(item.category, time.time())
                await self.remember(
                    user_id, item.fact, item.category, confidence=item.confidence,
                    importance=item.importance, source="extracted", source_session=session_id,
                    source_turn_ids=[t.id for t in cited], updates_previous=item.updates_previous,
                    expires_at=expires,
                )
            await evict_down_to(self.facts, user_id, self.settings.fact_cap)

    async def remember(
        self, user_id: str, text: str, category: str, *, confidence: float, importance: int,
        source: str, source_session: str | None, expires_at: float | None,
        source_turn_ids: Sequence[int] = (), updates_previous: int | bool | None = None,
        pinned: bool = False, client: str | None = None,
    ) -> Fact:
        """Keep a fact as learning keeps what it extracts: a duplicate of an active fact
        merges into it, a new value of the same subject supersedes it (fact_rules.decide),
        anything else is added; its vector is written now."""
        vector = (await self.embed([text]))[0]
        neighbours = await self._neighbours(user_id, vector, NEIGHBOURS)
        previous = updates_previous
        if isinstance(previous, int) and not isinstance(previous, bool) and all(
            n.id != previous for n in neighbours
        ):
            named = await self.facts.get(user_id, previous)
            if named is not None and named.active:
                neighbours.append(Neighbour(named.id, named.text, named.category, 0.0))
        decision = decide(text, category, previous, neighbours, self.settings.fact_merge_similarity)
        if decision.action == "merge" and decision.target is not None:
            fact = await self.facts.merge(
                user_id, decision.target, confidence_step=MERGE_CONFIDENCE_STEP,
                source_turn_ids=source_turn_ids, expires_at=expires_at,
            )
            # Its vector is unchanged; a pin asked for now holds for the merged fact.
            return await self.facts.set_pinned(user_id, fact.id, True) if pinned else fact
        if decision.action == "supersede" and decision.target is not None:
            fact = await self.facts.supersede(
                user_id, decision.target, text=text, category=category,
                confidence=confidence, importance=importance, expires_at=expires_at,
                source=source, source_session=source_session, source_turn_ids=source_turn_ids,
                restart=True, client=client,
            )
            await self.vectors.delete(ids=[f"f{decision.target}"])
            if pinned and not fact.pinned:
                fact = await self.facts.set_pinned(user_id, fact.id, True)
        else:
            fact = await self.facts.add(
                user_id, text, category, confidence=confidence, importance=importance,
                source=source, source_session=source_session, source_turn_ids=source_turn_ids,
                expires_at=expires_at, pinned=pinned, client=client,
            )
        # Now, not only by the queued sync job: the next item of this answer must see it.
        await self.vectors.add([f"f{fact.id}"], vector.reshape(1, -1), [fact_metadata(fact)])
        return fact

    async def _neighbours(self, user_id: str, vector: np.ndarray, k: int) -> list[Neighbour]:
        await self.vectors.refresh([user_id])  # facts another replica learned count too
        hits = await self.vectors.query(vector, k=k, where={"user_id": user_id, "source": "fact"})
        similarity = {int(key[1:]): score for key, score in hits}
        found = await self.facts.get_many(user_id, list(similarity))
        return [Neighbour(f.id, f.text, f.category, similarity[f.id]) for f in found if f.active]

    # -- summaries

    async def summarize(self, payload: dict[str, Any]) -> None:
        """The summarize job: fold the session's new turns into its rolling summary."""
        user_id, session_id = str(payload["user_id"]), str(payload["session_id"])
        turn_id = int(payload["turn_id"])
        # The model call too: a job that read the previous summary must store its successor
        # before another job reads it (the worker runs two jobs at once, and replicas more).
        async with summary_lock(self.summaries.db, user_id, session_id):
            previous = await self.summaries.latest(user_id, session_id)
            if previous is not None and previous.last_turn_id >= turn_id:
                return  # already covered (a retried or late job)
            turns = await self.log.path(user_id, turn_id, MAX_SUMMARY_TURNS)
            if previous is not None:
                turns = [t for t in turns if t.id > previous.last_turn_id]
            if not turns:
                return
            cap = self.settings.summary_max_tokens
            messages = summary_messages(turns, previous.text if previous else None, int(cap * 0.7))
            draft = await self._ask(payload, messages, user_id, validate_summary)
            text, tokens = _cap_tokens(draft.text, cap)
            covered = {*(previous.source_turn_ids if previous else ()), *(t.id for t in turns)}
            await self.summaries.put(
                user_id, session_id, text, draft.data, source_turn_ids=sorted(covered),
                last_turn_id=turn_id, user_turns=int(payload.get("user_turns", 0)), tokens=tokens,
            )

    # -- shared

    async def _ask(
        self, payload: dict[str, Any], messages: list[dict[str, Any]], user_id: str,
        validate: Callable[[Any], T],
    ) -> T:
        """Ask the job's model on its route; one repair request on unusable output, then
        give up for good."""
        if self.llm is None:
            raise RuntimeError("no language model is configured for learning jobs")
        model, route = str(payload["model"]), str(payload.get("route") or DEFAULT_ROUTE)
        raw = await self.llm(model, messages, user_id=user_id, route=route)
        try:
            return validate(parse_json(raw))
        except MalformedOutput as exc:
            error = str(exc)
        again = await self.llm(
            model, repair_messages(messages, raw, error), user_id=user_id, route=route
        )
        try:
            return validate(parse_json(again))
        except MalformedOutput as exc:
            raise JobFailed(
                f"unusable model output after one repair: {error}; then: {exc}\n"
                f"--- first answer ---\n{raw}\n--- repair answer ---\n{again}"
            ) from None


def _cap_tokens(text: str, cap: int) -> tuple[str, int]:
    """The text cut to at most `cap` tokens (at a sentence end when one is near)."""
    encoding = encoding_for_model(COUNT_MODEL)
    tokens = encoding.encode(text, disallowed_special=())
    if len(tokens) <= cap:
        return text, len(tokens)
    cut = encoding.decode(tokens[:cap])
    end = cut.rfind(". ")
    if end > len(cut) // 2:
        cut = cut[: end + 1]
    while len(encoding.encode(cut, disallowed_special=())) > cap:  # decode can re-merge
        cut = cut[:-1]
    return cut, len(encoding.encode(cut, disallowed_special=()))
