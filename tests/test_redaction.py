"""Secret redaction (MEMPROXY_REDACT): secrets never reach the data directory or the logs.

The end-to-end tests run memproxy with memory on and the real SDK as the client, then read
every byte under the data directory (SQLite database, WAL, the Chroma directory) and the
captured logs. The `off` test proves the same scan does find a secret that is stored.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import openai
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam

from config import SettingsError, load_settings
from memory.redact import Redactor, luhn_valid, placeholder
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import memory_api
from tests.support.scripted_upstream import ScriptedUpstream

Starter = Callable[..., RunningProxy]
ALNUM = string.ascii_letters + string.digits
B64 = ALNUM + "+/"
ALICE = {"X-Memory-User-Id": "alice"}


@dataclass(frozen=True)
class Secret:
    kind: str
    needles: tuple[str, ...]  # what must never be stored
    text: str  # a message carrying it


def _random(rng: random.Random, alphabet: str, size: int) -> str:
    chars = [rng.choice(alphabet) for _ in range(size)]
    chars[rng.randrange(size)] = rng.choice(string.digits)  # real keys hold digits
    return "".join(chars)


def luhn_complete(rng: random.Random, prefix: str, length: int) -> str:
    """A Luhn-valid card number starting with `prefix`."""
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    return next(body + d for d in string.digits if luhn_valid(body + d))


def fake_secrets(seed: int) -> list[Secret]:
    """One message per kind of secret, made up afresh so nothing else can contain them."""
    rng = random.Random(seed)
    openai_key = "sk-proj-" + _random(rng, ALNUM + "_-", 48)
    anthropic_key = "sk-ant-api03-" + _random(rng, ALNUM + "_-", 80)
    legacy_key = "sk-" + _random(rng, ALNUM, 48)
    jwt = ".".join(("eyJ" + _random(rng, ALNUM, 30), _random(rng, ALNUM, 40), _random(rng, ALNUM, 30)))
    aws = "AKIA" + _random(rng, string.ascii_uppercase + string.digits, 16)
    github = "ghp_" + _random(rng, ALNUM, 36)
    pem = [_random(rng, B64, 64) for _ in range(4)]
    password = _random(rng, ALNUM, 12) + "!"
    return [
        Secret("api_key", (openai_key,), f"My OpenAI key is {openai_key}, keep it safe."),
        Secret("api_key", (anthropic_key,), f"export ANTHROPIC_API_KEY={anthropic_key}"),
        Secret("api_key", (legacy_key,), f"the old key was {legacy_key}"),
        Secret("bearer_token", (jwt,),
               f"curl -H 'Authorization: Bearer {jwt}' https://api.example.com/v1/items"),
        Secret("aws_access_key", (aws,), f"[default]\naws_access_key_id = {aws}\nregion = eu-west-1"),
        Secret("github_token", (github,), f"git clone https://x:{github}@github.com/acme/app.git"),
        Secret("private_key", tuple(pem),
               "deploy key:\n-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(pem)
               + "\n-----END OPENSSH PRIVATE KEY-----\nthat is the one for staging"),
        Secret("password", (password,), f"db settings: host=db.local password={password} port=5432"),
    ]


def data_bytes(proxy: RunningProxy) -> dict[Path, bytes]:
    """Every file under the data directory: database, WAL, Chroma's files."""
    root = proxy.state.settings.data_dir
    files = {path: path.read_bytes() for path in root.rglob("*") if path.is_file()}
    assert any(p.name.endswith(".db") for p in files) and any("chroma" in str(p) for p in files)
    return files


def found_in(files: dict[Path, bytes], needles: Iterable[str]) -> list[tuple[str, Path]]:
    return [(n, path) for n in needles for path, data in files.items() if n.encode() in data]


def params(messages: list[dict[str, str]]) -> list[ChatCompletionMessageParam]:
    return cast("list[ChatCompletionMessageParam]", messages)


def converse(proxy: RunningProxy, secrets: list[Secret], session: str) -> list[dict[str, str]]:
    """Send each secret as the next user turn of one conversation, streamed every other
    time, resending the whole history as clients do; returns the history."""
    history: list[dict[str, str]] = []
    for i, secret in enumerate(secrets):
        history.append({"role": "user", "content": secret.text})
        reply = chat(proxy, history, session=session, headers=ALICE, stream=i % 2 == 1)
        history.append({"role": "assistant", "content": reply.text})
    return history


def test_secrets_never_reach_the_data_dir_or_the_logs(
    start_proxy: Starter, upstream: ScriptedUpstream, capfd: pytest.CaptureFixture[str]
) -> None:
    proxy = start_proxy(memory=True, log_level="debug")
    secrets = fake_secrets(seed=1)
    history = converse(proxy, secrets, "vault")
    # Manual facts, imported conversations, facts and summaries go through it too.
    extra = fake_secrets(seed=2)
    key, bearer, github, password = (extra[0], extra[3], extra[5], extra[7])
    imported = "\n".join(json.dumps(line) for line in [
        {"type": "conversation", "session_id": "imported", "messages": [
            {"role": "user", "content": key.text}, {"role": "assistant", "content": "Noted."}]},
        {"type": "fact", "text": f"User's CI token is {github.needles[0]}", "category": "project"},
        {"type": "summary", "session_id": "imported", "text": f"Uses {bearer.text}",
         "data": {"facts": [f"password is {password.needles[0]}"]}},
    ])
    with memory_api(proxy, **ALICE) as api:
        added = api.post("/facts", json={"text": f"User's staging password is {password.needles[0]}",
                                         "category": "project"})
        assert added.status_code == 201, added.text
        report = api.post("/import", content=imported)
        assert report.status_code == 200, report.text
        assert report.json()["added"] == {"turns": 2, "facts": 1, "summaries": 1, "profile": 0}
    all_needles = [n for s in secrets + extra for n in s.needles]

    # The upstream got every message exactly as the client sent it.
    sent = [r.json["messages"][-1]["content"] for r in upstream.history]
    assert sent == [s.text for s in secrets]

    wait_for_jobs(proxy)
    redact = Redactor()
    with memory_api(proxy, **ALICE) as api:
        turns = api.get("/turns", params={"session_id": "vault"}).json()["data"]
        facts = api.get("/facts").json()["data"]
        imported_turns = api.get("/turns", params={"session_id": "imported"}).json()["data"]
        found = api.post("/search", json={"query": "what was my OpenAI key and the db password?"})
    # Each turn stored once, with a typed placeholder where the secret was.
    assert [t["content"] for t in turns] == [redact(m["content"]) for m in history]
    for secret, user_turn, reply in zip(secrets, turns[::2], turns[1::2], strict=True):
        assert placeholder(secret.kind) in user_turn["content"], user_turn
        assert reply["content"].startswith("echo: ") and placeholder(secret.kind) in reply["content"]
    assert placeholder("api_key") in imported_turns[0]["content"]
    fact_texts = sorted(f["text"] for f in facts)
    assert fact_texts == ["User's CI token is [REDACTED:github_token]",
                          "User's staging password is [REDACTED:password]"]
    assert found.status_code == 200 and placeholder("api_key") in found.text
    assert not [n for n in all_needles if n in found.text]

    # The conversation's own turns, resent in the request, are not recalled as memory.
    with openai.OpenAI(base_url=proxy.base_url, api_key="sk-test", max_retries=0) as client:
        dry = client.chat.completions.with_raw_response.create(
            model="gpt-4o",
            messages=params([*history, {"role": "user", "content": "and my OpenAI key?"}]),
            extra_headers={**ALICE, "X-Memory-Session-Id": "vault", "X-Memory-Dry-Run": "on"},
        )
    items = dry.http_response.json()["items"]
    assert [i for i in items if i["source"] == "turn" and i["session_id"] == "vault"] == []

    # Not one byte of any secret in the database, its WAL or the vector index, while
    # running and after shutdown; the placeholders are there.
    running = data_bytes(proxy)
    assert any(p.name.endswith("-wal") for p in running)
    assert found_in(running, all_needles) == []
    assert any(b"[REDACTED:private_key]" in data for data in running.values())
    proxy.stop()
    assert found_in(data_bytes(proxy), all_needles) == []
    logs = capfd.readouterr()
    assert '"logger":"memproxy.chat"' in logs.err.replace(" ", "")  # the logs were captured
    assert not [n for n in all_needles if n in logs.err or n in logs.out]


def test_off_stores_text_verbatim(start_proxy: Starter, upstream: ScriptedUpstream) -> None:
    proxy = start_proxy(memory=True, redact="off")
    secrets = [s for s in fake_secrets(seed=3) if s.kind in ("api_key", "private_key")]
    history = converse(proxy, secrets, "plain")
    wait_for_jobs(proxy)
    with memory_api(proxy, **ALICE) as api:
        turns = api.get("/turns", params={"session_id": "plain"}).json()["data"]
    assert [t["content"] for t in turns] == [m["content"] for m in history]
    # The scan that finds nothing above does find a secret that was stored.
    needles = [n for s in secrets for n in s.needles]
    assert {n for n, _ in found_in(data_bytes(proxy), needles)} == set(needles)


def test_cards_only_when_configured(start_proxy: Starter, upstream: ScriptedUpstream) -> None:
    rng = random.Random(4)
    visa, amex = luhn_complete(rng, "4", 16), luhn_complete(rng, "37", 15)
    spaced = " ".join(visa[i : i + 4] for i in range(0, 16, 4))
    wrong = visa[:-1] + str((int(visa[-1]) + 1) % 10)  # Luhn-invalid
    text = f"pay with {spaced} or {amex}; order id {wrong}, at 1716400000000 ms"
    proxy = start_proxy(memory=True, redact="secrets,cards")
    converse(proxy, [Secret("card_number", (visa, amex), text)], "cards")
    wait_for_jobs(proxy)
    with memory_api(proxy, **ALICE) as api:
        stored = api.get("/turns", params={"session_id": "cards"}).json()["data"][0]["content"]
    assert stored == (f"pay with {placeholder('card_number')} or {placeholder('card_number')};"
                      f" order id {wrong}, at 1716400000000 ms")
    assert found_in(data_bytes(proxy), [spaced, amex]) == []
    assert Redactor("secrets")(text) == text  # the default leaves numbers alone


# -- the patterns ------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("Authorization: Bearer abcDEF123456ghiJKL789",
     "Authorization: Bearer [REDACTED:bearer_token]"),
    ('{"password": "hunter2 with spaces"}', '{"password": "[REDACTED:password]"}'),
    ("DB_PASSWORD=s3cr3t-Value", "DB_PASSWORD=[REDACTED:password]"),
    ("password: Summer2024!", "password: [REDACTED:password]"),
    ("my password is hunter22.", "my password is [REDACTED:password]."),
    ("postgres://app:Pa55word@db:5432/app", "postgres://app:[REDACTED:password]@db:5432/app"),
    ("key AIzaSyA1234567890abcdefghijklmnopqrstuv ok", "key [REDACTED:api_key] ok"),
    ("slack xoxb-123456789012-abcdefABCDEF", "slack [REDACTED:api_key]"),
    ("pat github_pat_11ABCDEFG0123456789_abcdefghijklmnop", "pat [REDACTED:github_token]"),
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC", "[REDACTED:private_key]"),
    ("ASIAY34FZKBOKMUTVV7A.", "[REDACTED:aws_access_key]."),
])
def test_patterns(text: str, expected: str) -> None:
    assert Redactor()(text) == expected


@pytest.mark.parametrize("text", [
    "pip install scikit-learn; import sklearn; sk-learn is its old name",
    "a task-management-system-for-teams and a desk-organiser",
    "The password is required. Forgot password: click the link.",
    "connect(user=user, password=password, host=host)",
    "password = get_password()  # and password=os.environ.get later",
    'password = ${DB_PASSWORD} or PASSWORD=$DB_PASS or password: <your-password>',
    "the bearer of this letter; Bearer authentication uses a token",
    "AKIA is a prefix; ghp_ too; -----BEGIN PUBLIC KEY-----",
    "https://example.com:8080/path@v2 and user@example.com",
    "ids 1716400000000 and 3.2415926535897932, phone 555-0100",
])
def test_ordinary_text_is_kept(text: str) -> None:
    assert Redactor("secrets,cards")(text) == text


PROSE = st.sampled_from(
    "the a user wants to keep password passwords token tokens key keys bearer secret sk "
    "learn task desk api AKIA ghp github BEGIN END PRIVATE PUBLIC is was : = , . ; ( ) "
    "def return self get_password os.environ config password_hash pass pwd print import "
    "0 1 7 42 99".split()
)


@settings(max_examples=300, deadline=None)
@given(st.lists(PROSE, max_size=40).map(" ".join))
@example("password : is")
@example("pass = pwd")
def test_no_false_positives_on_prose_and_code(text: str) -> None:
    assert Redactor("secrets,cards")(text) == text


@settings(max_examples=200, deadline=None)
@given(
    st.lists(PROSE, max_size=15).map(" ".join),
    st.integers(0, 10_000),
    st.integers(0, 7),
    st.lists(PROSE, max_size=15).map(" ".join),
)
def test_a_secret_anywhere_in_text_is_redacted_and_redaction_is_idempotent(
    before: str, seed: int, which: int, after: str
) -> None:
    secret = fake_secrets(seed)[which]
    text = f"{before}\n{secret.text}\n{after}"
    redacted = Redactor()(text)
    assert not [n for n in secret.needles if n in redacted]
    assert placeholder(secret.kind) in redacted
    assert Redactor()(redacted) == redacted


@given(st.text(string.digits, min_size=12, max_size=18), st.integers(0, 17), st.integers(1, 9))
def test_luhn_catches_every_single_digit_error(body: str, position: int, delta: int) -> None:
    number = next(body + d for d in string.digits if luhn_valid(body + d))
    assert sum(luhn_valid(body + d) for d in string.digits) == 1  # one check digit fits
    at = position % len(number)
    changed = number[:at] + str((int(number[at]) + delta) % 10) + number[at + 1 :]
    assert not luhn_valid(changed)


def test_luhn_known_numbers() -> None:
    assert luhn_valid("4111111111111111") and luhn_valid("378282246310005")
    assert luhn_valid("79927398713") and not luhn_valid("79927398710")
    assert not luhn_valid("4111111111111112")


def test_bad_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="secrets,cards"):
        Redactor("cards")
    with pytest.raises(SettingsError, match="MEMPROXY_REDACT"):
        load_settings(env={"MEMPROXY_REDACT": "everything"})
    assert load_settings(env={}).redact == "secrets"
    assert Redactor("off")("sk-" + "a1" * 20) == "sk-" + "a1" * 20


def test_profiles_are_redacted_like_turns_facts_and_summaries(start_proxy: Starter) -> None:
    proxy = start_proxy(memory=True)
    key, _, _, bearer, aws, github, _, password = fake_secrets(seed=4)
    pw = password.needles[0]
    with memory_api(proxy, **ALICE) as api:
        assert api.put("/consent", json={"consent": True}).status_code == 200
        put = api.put("/profile", json={
            "fields": {"name": "Alice", "password": pw, "keys": [key.text],
                       "deploy": {"ci": bearer.text}, "age": 41},
            "text": f"Reach me any time.\n{aws.text}",
        })
        assert put.status_code == 200, put.text
        profile = put.json()["profile"]
        assert profile == api.get("/profile").json()["profile"]
    fields = profile["fields"]
    assert fields["name"] == "Alice" and fields["age"] == 41
    assert fields["password"] == placeholder("password")  # its key says what it is
    assert fields["keys"] == [f"My OpenAI key is {placeholder('api_key')}, keep it safe."]
    assert placeholder("bearer_token") in fields["deploy"]["ci"]
    assert profile["text"].startswith("Reach me any time.") and placeholder("aws_access_key") in profile["text"]

    # An imported profile too; importing it again finds it already there.
    bob = {"X-Memory-User-Id": "bob"}
    record = json.dumps({"type": "profile", "consent": True, "profile": {
        "fields": {"token": github.needles[0]}, "text": f"db password: {pw}"}})
    with memory_api(proxy, **bob) as api:
        assert api.post("/import", content=record).json()["added"]["profile"] == 1
        assert api.post("/import", content=record).json()["skipped"]["profile"] == 1
        imported = api.get("/profile").json()["profile"]
    assert imported["fields"] == {"token": placeholder("github_token")}
    assert imported["text"] == f"db password: {placeholder('password')}"

    wait_for_jobs(proxy)
    needles = [pw, *key.needles, *bearer.needles, *aws.needles, *github.needles]
    assert found_in(data_bytes(proxy), needles) == []
