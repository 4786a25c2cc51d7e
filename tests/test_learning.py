"""Learning end to end: the scripted upstream plays the extraction and summary model."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from memory.learning.profiles import profile_vector_id
from memory.recall.block import FACTS_HEADING, PROFILE_HEADING
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import (
    ErrorReply,
    JSONReply,
    Received,
    Reply,
    ScriptedUpstream,
    chat_completion,
)
from tests.support.sql import query as sql_query

pytestmark = pytest.mark.both_backends

EXTRACT = "You extract durable facts"
SUMMARY = "You summarise a conversation"
REPAIR = "Your answer could not be used"


class PlaysTheModel:
    """Answers memproxy's learning prompts from queues; other requests get the default echo."""

    def __init__(self) -> None:
        self.facts: deque[str | Reply] = deque()
        self.summaries: deque[str | Reply] = deque()
        self.repairs: deque[str | Reply] = deque()
        self.prompts: list[Received] = []

    def __call__(self, request: Received) -> Reply | None:
        messages = request.json.get("messages") if isinstance(request.json, dict) else None
        if not messages:
            return None
        first, last = str(messages[0].get("content")), str(messages[-1].get("content"))
        if last.startswith(REPAIR):
            queue, empty = self.repairs, "[]"
        elif first.startswith(EXTRACT):
            queue, empty = self.facts, "[]"
        elif first.startswith(SUMMARY):
            queue, empty = self.summaries, '{"text": "Nothing yet."}'
        else:
            return None
        self.prompts.append(request)
        scripted = queue.popleft() if queue else empty
        return JSONReply(chat_completion(scripted)) if isinstance(scripted, str) else scripted


def fact(text: str, category: str = "preference", **fields: Any) -> dict[str, Any]:
    return {"fact": text, "category": category, "confidence": 0.9, "importance": 8,
            "updates_previous": None, "expires": None, **fields}


def answer(*facts: dict[str, Any]) -> str:
    return json.dumps(list(facts))


def say(proxy: RunningProxy, text: str, *, user: str = "ada", session: str = "s1",
        history: list[dict[str, Any]] | None = None, key: str = "sk-test") -> str:
    """Ada's next message in session s1 unless told otherwise; returns the reply."""
    messages = [*(history or []), {"role": "user", "content": text}]
    return chat(proxy, messages, user=user, session=session, api_key=key).text


def query(proxy: RunningProxy, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    return sql_query(proxy.state.settings, sql, params)


def injected(upstream: ScriptedUpstream) -> str:
    """The system text of the last chat request that was not a learning call."""
    chats = [r for r in upstream.history if r.path.endswith("/chat/completions") and not any(
        str(m.get("content")).startswith((EXTRACT, SUMMARY)) for m in r.json["messages"][:1])]
    return "\n".join(m["content"] for m in chats[-1].json["messages"] if m["role"] == "system")


def fact_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.startswith("- (")]


@pytest.fixture
def model(upstream: ScriptedUpstream) -> PlaysTheModel:
    plays = PlaysTheModel()
    upstream.respond_with(plays)
    return plays


@pytest.fixture
def learning(start_proxy: Callable[..., RunningProxy], model: PlaysTheModel) -> RunningProxy:
    return start_proxy(memory=True, extract_every=1)


def test_facts_are_learned_and_injected_in_a_new_session(
    learning: RunningProxy, model: PlaysTheModel, upstream: ScriptedUpstream
) -> None:
    model.facts.append(answer(
        fact("User prefers TypeScript for new backend services.", turns=[1]),
        fact("User said hello.", "context", importance=3),  # below the importance threshold
    ))
    say(learning, "I prefer TypeScript for all our new backend services.",
        key="sk-client-secret-123")
    wait_for_jobs(learning)
    rows = query(learning, "SELECT text, source, source_session, source_turn_ids, category"
                           " FROM facts")
    assert rows == [("User prefers TypeScript for new backend services.", "extracted", "s1",
                     rows[0][3], "preference")]
    source = query(learning, "SELECT content FROM turns WHERE id = ?", (json.loads(rows[0][3])[0],))
    assert source == [("I prefer TypeScript for all our new backend services.",)]
    asked = model.prompts[0]
    assert asked.json["model"] == "gpt-4o" and asked.json.get("stream") is None
    assert "NEW" in asked.json["messages"][1]["content"]
    assert " user: I prefer TypeScript" in asked.json["messages"][1]["content"]
    assert " assistant: echo: I prefer" in asked.json["messages"][1]["content"]
    # Bring-your-own-key: the job used the client's key, which never reached the disk.
    assert asked.headers["authorization"] == "Bearer sk-client-secret-123"
    for path in learning.state.settings.data_dir.rglob("*"):
        if path.is_file():
            assert b"sk-client-secret-123" not in path.read_bytes(), path

    say(learning, "Which language should I use for the new billing backend service?",
        session="s2")
    block = injected(upstream)
    assert FACTS_HEADING in block
    assert fact_lines(block) == ["- (preference) User prefers TypeScript for new backend services."]
    assert block.index(FACTS_HEADING) < block.index("Relevant past turns:")


def test_a_reply_and_its_learning_job_are_stored_together(
    learning: RunningProxy, model: PlaysTheModel
) -> None:
    # The database refuses the extraction job: the reply it would learn from is not kept
    # either, so no reply is ever stored without its learning (nor after a crash between).
    settings = learning.state.settings
    if settings.database_url:
        sql_query(settings, "CREATE FUNCTION refuse_learning() RETURNS trigger LANGUAGE plpgsql"
                  " AS $$ BEGIN IF NEW.kind = 'extract_facts' THEN RAISE EXCEPTION 'no'; END IF;"
                  " RETURN NEW; END $$")
        sql_query(settings, "CREATE TRIGGER refuse_learning BEFORE INSERT ON jobs"
                  " FOR EACH ROW EXECUTE FUNCTION refuse_learning()")
    else:
        sql_query(settings, "CREATE TRIGGER refuse_learning BEFORE INSERT ON jobs"
                  " WHEN NEW.kind = 'extract_facts' BEGIN SELECT RAISE(ABORT, 'no'); END")
    first = [{"role": "user", "content": "I prefer TypeScript for new backend services."}]
    reply = say(learning, first[0]["content"])
    wait_for_jobs(learning)
    assert query(learning, "SELECT role FROM turns") == [("user",)]
    assert query(learning, "SELECT count(*) FROM jobs WHERE kind = 'extract_facts'") == [(0,)]

    sql_query(settings, "DROP TRIGGER refuse_learning" + (" ON jobs" if settings.database_url else ""))
    model.facts.append(answer(fact("User prefers TypeScript for new backend services.")))
    # The client resends the history: the old reply is stored now, once, as history; the
    # new reply with its job.
    say(learning, "And for scripts?", history=[*first, {"role": "assistant", "content": reply}])
    wait_for_jobs(learning)
    assert [r[0] for r in query(learning, "SELECT role FROM turns ORDER BY id")] == [
        "user", "assistant", "user", "assistant"]
    jobs = query(learning, "SELECT payload FROM jobs"
                           " WHERE kind = 'extract_facts' AND status = 'done' ORDER BY id")
    replies = query(learning, "SELECT id FROM turns WHERE role = 'assistant' ORDER BY id")
    assert [json.loads(payload)["turn_id"] for (payload,) in jobs] == [replies[1][0]]


def test_a_repeated_fact_merges_and_a_contradiction_supersedes(
    learning: RunningProxy, model: PlaysTheModel, upstream: ScriptedUpstream
) -> None:
    lives = fact("User lives in Berlin.", "identity", confidence=0.8)
    model.facts.extend([answer(lives), answer(lives)])
    say(learning, "I live in Berlin.", session="s1")
    wait_for_jobs(learning)
    say(learning, "Still living in Berlin, by the way.", session="s2")
    wait_for_jobs(learning)
    [(berlin, mentions, confidence)] = query(learning, "SELECT id, mentions, confidence FROM facts")
    assert mentions == 2 and confidence == pytest.approx(0.95)

    model.facts.append(answer(fact("User lives in Lisbon.", "identity")))  # same subject
    say(learning, "Big news: I live in Lisbon now.", session="s3")
    wait_for_jobs(learning)
    rows = query(learning, "SELECT id, text, valid_to IS NULL, superseded_by, previous_id,"
                           " version, mentions FROM facts ORDER BY id")
    lisbon = rows[1][0]
    assert rows == [(berlin, "User lives in Berlin.", 0, lisbon, None, 1, 2),
                    (lisbon, "User lives in Lisbon.", 1, None, berlin, 2, 1)]

    model.facts.append(answer(fact("User's favourite editor is Helix.")))
    say(learning, "My favourite editor is Helix.", session="s4")
    wait_for_jobs(learning)
    [(helix,)] = query(learning, "SELECT id FROM facts WHERE text LIKE '%Helix%'")
    model.facts.append(answer(fact("User switched to Neovim for editing.", updates_previous=helix)))
    say(learning, "I switched to Neovim for editing.", session="s5")
    wait_for_jobs(learning)
    assert "Known facts about the user" in model.prompts[-1].json["messages"][1]["content"]
    active = query(learning, "SELECT text FROM facts WHERE valid_to IS NULL ORDER BY id")
    assert active == [("User lives in Lisbon.",), ("User switched to Neovim for editing.",)]

    say(learning, "Where do I live and which editor do I use these days?", session="s6")
    lines = fact_lines(injected(upstream))
    assert "- (identity) User lives in Lisbon." in lines
    assert not any("Berlin" in line or "Helix" in line for line in lines)


def test_malformed_output_is_repaired_once_else_the_job_is_dead_with_the_raw_text(
    learning: RunningProxy, model: PlaysTheModel
) -> None:
    fenced = answer(fact("User runs Postgres 16 in production.", "project"))[:-1] + ",]"
    model.facts.append(f"Sure! Here are the facts:\n```json\n{fenced}\n```\nAnything else?")
    say(learning, "We run Postgres 16 in production.")
    wait_for_jobs(learning)
    assert len(model.prompts) == 1  # repaired locally: no second call
    model.facts.append("I could not find any facts worth keeping.")
    model.repairs.append(answer(fact("User deploys on Fridays.", "decision")))
    say(learning, "We decided to deploy on Fridays.")
    wait_for_jobs(learning)
    repair = model.prompts[-1].json["messages"]
    assert len(model.prompts) == 3 and repair[-2]["content"].startswith("I could not find")
    assert "holds no JSON value" in repair[-1]["content"]
    model.facts.append("nope")
    model.repairs.append('[{"fact": 3}]')
    say(learning, "We use Grafana for dashboards.")
    wait_for_jobs(learning)
    texts = [row[0] for row in query(learning, "SELECT text FROM facts ORDER BY id")]
    assert texts == ["User runs Postgres 16 in production.", "User deploys on Fridays."]
    [(kind, error)] = query(learning, "SELECT kind, last_error FROM jobs WHERE status = 'dead'")
    assert kind == "extract_facts"
    assert "--- first answer ---\nnope" in error and '[{"fact": 3}]' in error


def test_a_failed_learning_call_keeps_no_key_in_the_job_table(
    start_proxy: Callable[..., RunningProxy], model: PlaysTheModel
) -> None:
    proxy = start_proxy(memory=True, extract_every=1, job_max_attempts=1)
    model.facts.append(ErrorReply(401, "Incorrect API key provided: sk-client-xyz-987."))
    say(proxy, "I write all my services in Elixir.", key="sk-client-xyz-987")
    wait_for_jobs(proxy)
    [(error,)] = query(proxy, "SELECT last_error FROM jobs WHERE status = 'dead'")
    assert "HTTP 401" in error and "[key]" in error
    for path in proxy.state.settings.data_dir.rglob("*"):
        if path.is_file():
            assert b"sk-client-xyz-987" not in path.read_bytes(), path


def test_a_client_key_never_follows_the_learning_call_to_another_upstream(
    start_proxy: Callable[..., RunningProxy], model: PlaysTheModel, upstream: ScriptedUpstream
) -> None:
    elsewhere = upstream.base_url.replace("127.0.0.1", "localhost")  # same server, other URL
    proxy = start_proxy(memory=True, extract_every=1, extract_base_url=elsewhere,
                        extract_model="small-extractor")
    model.facts.append(answer(fact("User writes all services in Elixir.", "project")))
    say(proxy, "I write all my services in Elixir.", key="sk-client-abc-123")
    wait_for_jobs(proxy)
    [asked] = model.prompts
    assert asked.json["model"] == "small-extractor" and "authorization" not in asked.headers
    assert query(proxy, "SELECT text FROM facts") == [("User writes all services in Elixir.",)]


def test_the_assistants_own_statements_are_not_extracted(
    learning: RunningProxy, model: PlaysTheModel, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(JSONReply(chat_completion(
        "Your server runs Debian 12; enable unattended-upgrades.")), path="/v1/chat/completions")
    model.facts.append(answer(
        fact("User's server runs Debian 12.", "context", turns=[2]),  # cites the assistant
        fact("User's server runs Debian 12.", "context", turns=[1]),  # the assistant's words
        fact("User manages a home server themselves.", "context"),
    ))
    say(learning, "How do I keep my home server patched? I manage it myself.")
    wait_for_jobs(learning)
    assert query(learning, "SELECT text FROM facts") == [("User manages a home server themselves.",)]


def test_learning_keeps_at_most_fact_cap_facts_and_never_evicts_pinned_ones(
    start_proxy: Callable[..., RunningProxy], model: PlaysTheModel
) -> None:
    proxy = start_proxy(memory=True, extract_every=1, fact_cap=2)
    model.facts.append(answer(fact("User's team is called Falcon.", "relationship")))
    say(proxy, "My team is called Falcon.")
    wait_for_jobs(proxy)
    [(falcon,)] = query(proxy, "SELECT id FROM facts")
    pinned = httpx.post(f"{proxy.base_url}/memory/facts/{falcon}/pin",
                        headers={"X-Memory-User-Id": "ada"})
    assert pinned.status_code == 200
    model.facts.append(answer(
        fact("User is on call this week.", "context", confidence=0.7),
        fact("User prefers short answers.", confidence=0.95),
    ))
    say(proxy, "I am on call this week, and please keep answers short.")
    wait_for_jobs(proxy)
    assert query(proxy, "SELECT text FROM facts ORDER BY id") == [
        ("User's team is called Falcon.",), ("User prefers short answers.",)]


def test_summaries_roll_up_every_n_user_turns(
    start_proxy: Callable[..., RunningProxy], model: PlaysTheModel, upstream: ScriptedUpstream
) -> None:
    proxy = start_proxy(memory=True, summary_every=2)
    model.summaries.extend([
        json.dumps({"text": "The user set up Postgres 16.", "facts": ["Postgres 16"],
                    "entities": ["Postgres"]}),
        json.dumps({"text": "The user set up Postgres 16 and Grafana dashboards.",
                    "decisions": ["Grafana for dashboards"], "entities": ["Postgres", "Grafana"]}),
    ])
    history: list[dict[str, Any]] = []
    for i, text in enumerate(["We are setting up Postgres 16.", "It runs on two replicas.",
                              "Next we add Grafana dashboards.", "Alerts go to the ops channel."]):
        reply = say(proxy, text, history=history)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        wait_for_jobs(proxy)
        assert len(query(proxy, "SELECT id FROM summaries")) == (i + 1) // 2
    rows = query(proxy, "SELECT text, superseded_by IS NULL, user_turns, source_turn_ids, data"
                        " FROM summaries ORDER BY id")
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("The user set up Postgres 16.", 0, 2),
        ("The user set up Postgres 16 and Grafana dashboards.", 1, 4)]
    assert len(json.loads(rows[1][3])) == 8  # all turns of the session, both summaries' worth
    assert json.loads(rows[1][4])["decisions"] == ["Grafana for dashboards"]
    second = model.prompts[1].json["messages"][1]["content"]
    assert "Previous summary: The user set up Postgres 16." in second
    assert "two replicas" not in second and "Grafana dashboards" in second  # rolled in

    say(proxy, "What did we set up for dashboards and the database?", session="later")
    block = injected(upstream)
    assert "Summary of an earlier conversation" in block
    assert "Postgres 16 and Grafana dashboards." in block


def test_the_profile_is_used_only_with_consent_and_revoking_deletes_it(
    start_proxy: Callable[..., RunningProxy], upstream: ScriptedUpstream, embedder: Any
) -> None:
    proxy = start_proxy(memory=True)
    api = httpx.Client(base_url=f"{proxy.base_url}/memory", headers={"X-Memory-User-Id": "ada"})
    profile = {"fields": {"name": "Ada", "role": "staff engineer"},
               "text": "I maintain the billing platform."}
    assert api.put("/profile", json=profile).status_code >= 400  # no consent yet
    assert api.put("/consent", json={"consent": True}).status_code == 200
    assert api.put("/profile", json=profile).status_code == 200
    wait_for_jobs(proxy)
    vectors = proxy.state.memory.vectors
    probe = embedder.embed_sync(["staff engineer"])[0]

    def profile_vectors() -> list[str]:
        hits = vectors.query(probe, k=5, where={"user_id": "ada", "source": "profile"})
        return [key for key, _ in hits]

    assert profile_vectors() == [profile_vector_id("ada")]
    say(proxy, "What is my role on the team?", session="q1")
    block = injected(upstream)
    assert PROFILE_HEADING in block and "role: staff engineer" in block
    say(proxy, "What is my role on the team?", user="bob", session="q1")
    assert "staff engineer" not in injected(upstream)

    assert api.put("/consent", json={"consent": False}).status_code == 200
    assert query(proxy, "SELECT * FROM profiles") == []
    wait_for_jobs(proxy)
    assert profile_vectors() == []
    say(proxy, "What is my role on the team?", session="q2")
    assert "staff engineer" not in injected(upstream)
    api.close()
