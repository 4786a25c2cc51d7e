"""Excerpts of long items and near-duplicates packed once (memory.recall.excerpt), alone and
through memproxy's dry run."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from memory.recall.excerpt import excerpt, excerpt_ranked, one_per_turn, query_terms
from memory.recall.ranking import Candidate
from memory.recall.render import Entry, render_line
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.scripted_upstream import JSONReply, ScriptedUpstream, chat_completion

FILLER = [
    "Let's walk through the setup of the development environment step by step.",
    "First install the dependencies listed in the requirements file with pip.",
    "Then create a virtual environment so the packages stay isolated from the system.",
    "Make sure the configuration file points at the local database during development.",
    "Run the test suite before every commit to catch regressions early on.",
    "Keep the secrets out of the repository and load them from the environment instead.",
]
ANSWER = "The first sprint ends on March 29, with registration and login as its goal."
CODE = "```python\ndef monthly_summary(transactions):\n    totals = defaultdict(float)\n" \
       "    for item in transactions:\n        totals[item.category] += item.amount\n" \
       "    return dict(totals)\n```"


def reply_with_answer_inside() -> str:
    return " ".join([*FILLER[:3], ANSWER, *FILLER[3:]])


def test_a_long_item_is_cut_to_the_run_that_holds_the_words() -> None:
    terms = query_terms({"first": 400, "sprint": 12, "end": 90})
    matched = Candidate("c1", "s", 0.0, reply_with_answer_inside(), "assistant", dense=0.4)
    shown = excerpt(matched, terms, cap=200)
    assert shown.text == ANSWER and shown.cut == (True, True)
    line = render_line(Entry("assistant", 0.0, shown.text, cut=shown.cut))
    assert line == f"assistant: … {ANSWER} …"
    # A neighbour that matched nothing itself: half the cap, from its start.
    context = Candidate("c2", "s", 0.0, reply_with_answer_inside(), "assistant")
    start = excerpt(context, terms, cap=200)
    assert start.text == FILLER[0] and start.cut == (False, True)
    # A short item is shown whole.
    short = Candidate("c3", "s", 0.0, ANSWER, "user", bm25=1.0)
    assert excerpt(short, terms, cap=200) is short


def test_a_reply_of_the_model_gets_half_the_cap() -> None:
    terms = query_terms({"sprint": 12, "deadline": 3})
    deadline = "The deadline for the demo is April 15."
    text = " ".join([*FILLER[:3], ANSWER, deadline, *FILLER[3:]])
    both = f"{ANSWER} {deadline}"
    said = {role: Candidate("c1", "s", 0.0, text, role, dense=0.4, role=role)
            for role in ("user", "assistant")}
    # Both sentences fit in 200 characters; a reply of the model gets 100: the rarer word's.
    assert excerpt(said["user"], terms, cap=200).text == both
    assert excerpt(said["assistant"], terms, cap=200).text == deadline
    # A named speaker (chat between people) gets the whole cap.
    named = Candidate("c1", "s", 0.0, text, "Bo", dense=0.4, role="assistant")
    assert excerpt(named, terms, cap=200).text == both


def test_the_same_code_twice_is_packed_once() -> None:
    terms = query_terms({"summary": 3})
    asked = Candidate("c1", "s", 0.0, "Here is my monthly summary:\n" + CODE, "user", bm25=1.0)
    copied = Candidate("c2", "s", 1.0, CODE + "\nThis works as is.", "assistant", bm25=0.9)
    other = Candidate("c3", "s", 2.0, "A different monthly summary, by week.", "user", bm25=0.5)
    assert [c.key for c in excerpt_ranked([asked, copied, other], terms, 60)] == ["c1", "c3"]
    assert excerpt_ranked([asked, copied], terms, 0) == [asked, copied]  # 0: off


def test_a_long_sentence_is_shown_whole_up_to_twice_the_cap() -> None:
    terms = query_terms({"sprint": 12})
    sentence = "I'm trying to plan the sprint so that registration, login and the first " \
               "dashboard all land before the demo, can you help me order the tasks?"
    text = " ".join([*FILLER, sentence, *FILLER])
    shown = excerpt(Candidate("c1", "s", 0.0, text, "user", bm25=1.0), terms, cap=100)
    assert len(sentence) > 100 and shown.text == sentence
    # Past twice the cap, it is cut at a word.
    cut = excerpt(Candidate("c1", "s", 0.0, sentence * 3, "user", bm25=1.0), terms, cap=60)
    assert len(cut.text) <= 60 and sentence.startswith(cut.text) and cut.cut == (False, True)


def test_each_turn_s_best_chunk_comes_before_any_turn_s_second() -> None:
    def chunk(key: str, turn: int) -> Candidate:
        return Candidate(key, "s", 0.0, key, "assistant", turn_id=turn)

    ranked = [chunk("a1", 1), chunk("a2", 1), chunk("a3", 1), chunk("b1", 2), chunk("a4", 1),
              chunk("c1", 3)]
    assert [c.key for c in one_per_turn(ranked)] == ["a1", "b1", "c1", "a2", "a3", "a4"]


@pytest.fixture
def memproxy(start_proxy: Callable[..., RunningProxy]) -> RunningProxy:
    return start_proxy(memory=True)


def test_a_long_reply_is_recalled_by_the_part_that_answers(
    memproxy: RunningProxy, upstream: ScriptedUpstream
) -> None:
    upstream.enqueue(JSONReply(chat_completion(reply_with_answer_inside())))
    chat(memproxy, [{"role": "user", "content": "Can you help me plan the project?"}],
         headers={"X-Memory-User-Id": "ada", "X-Memory-Session-Id": "s1"})
    wait_for_jobs(memproxy)
    with httpx.Client(base_url=memproxy.url, timeout=30) as http:
        result = http.post("/v1/chat/completions", headers={
            "X-Memory-Dry-Run": "on", "X-Memory-Budget": "1000", "X-Memory-User-Id": "ada",
            "X-Memory-Session-Id": "s2",
        }, json={"model": "gpt-4o", "messages": [
            {"role": "user", "content": "When does the first sprint end?"}]}).json()
    # The sentence that answers, with a little of what follows, not the reply's start or end.
    assert f"… {ANSWER}" in result["block"]
    assert FILLER[0] not in result["block"] and FILLER[-1] not in result["block"]
    (shown,) = [item["text"] for item in result["items"] if ANSWER in item["text"]]
    assert shown.startswith(ANSWER) and shown in reply_with_answer_inside()
