"""Secret shapes redaction catches (memory/redact.py), each tested both ways: a secret in
that shape is replaced by its placeholder, and ordinary text that looks like it is kept.

The end-to-end test sends every shape through memproxy (chat completions whole and
streamed, Responses, Messages) and reads what was stored, on both storage backends.
"""

from __future__ import annotations

import base64
import random
import string
from dataclasses import dataclass

import anthropic
import openai
import pytest

from memory.redact import Redactor, placeholder
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.memory import db_rows, memory_api
from tests.support.scripted_upstream import ScriptedUpstream
from tests.test_redaction import Starter, data_bytes, found_in

UPPER, LOWER, DIGITS = string.ascii_uppercase, string.ascii_lowercase, string.digits
ALNUM = UPPER + LOWER + DIGITS
B64URL = ALNUM + "_-"
ALICE = {"X-Memory-User-Id": "alice"}


@dataclass(frozen=True)
class Shape:
    kind: str
    secret: str  # what must never be stored
    text: str  # a message carrying it
    stored: str  # the message as stored


def _random(rng: random.Random, alphabet: str, size: int) -> str:
    """Random characters holding an upper-case letter, a lower-case letter and a digit."""
    chars = [rng.choice(alphabet) for _ in range(size - 3)]
    chars += [rng.choice(UPPER), rng.choice(LOWER), rng.choice(DIGITS)]
    rng.shuffle(chars)
    return "".join(chars)


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def shapes(seed: int) -> list[Shape]:
    """One message per new shape, with secrets made up afresh."""
    rng = random.Random(seed)
    jwt = ".".join((
        _b64url(b'{"alg":"HS256","typ":"JWT"}'),
        _b64url(b'{"sub":"%d","name":"Alice","iat":1716400000}' % rng.randrange(10**9)),
        _random(rng, B64URL, 43),
    ))
    aws_secret = _random(rng, ALNUM + "/+", 40)
    aws_csv_id = "AKIA" + "".join(rng.choice(UPPER + DIGITS) for _ in range(16))
    aws_csv_secret = _random(rng, ALNUM + "/+", 40)
    stripe, restricted, test = (f"{p}_" + _random(rng, ALNUM, 24) for p in ("sk_live", "rk_live", "sk_test"))
    hugging_face = "hf_" + _random(rng, UPPER + LOWER, 34)
    gitlab = "glpat-" + _random(rng, B64URL, 20)
    basic = base64.b64encode(f"deploy:{_random(rng, ALNUM, 14)}".encode()).decode()
    pw, pass_, pwd, quoted_pw = (_random(rng, ALNUM, 12) + "!" for _ in range(4))
    secret_key, client_secret, token, api_key = (_random(rng, ALNUM, 32) for _ in range(4))
    p = placeholder
    return [
        Shape("jwt", jwt, f"my session token: {jwt} (expires tonight)",
              f"my session token: {p('jwt')} (expires tonight)"),
        Shape("aws_secret_key", aws_secret,
              f"[default]\naws_secret_access_key = {aws_secret}\nregion = eu-west-1",
              f"[default]\naws_secret_access_key = {p('aws_secret_key')}\nregion = eu-west-1"),
        Shape("aws_secret_key", aws_csv_secret,
              f"Access key ID,Secret access key\n{aws_csv_id},{aws_csv_secret}",
              f"Access key ID,Secret access key\n{p('aws_access_key')},{p('aws_secret_key')}"),
        Shape("api_key", stripe, f"STRIPE_KEY is {stripe} in prod", f"STRIPE_KEY is {p('api_key')} in prod"),
        Shape("api_key", restricted, f"the read-only one: {restricted}.", f"the read-only one: {p('api_key')}."),
        Shape("api_key", test, f"stripe.api_key = '{test}'", f"stripe.api_key = '{p('api_key')}'"),
        Shape("api_key", hugging_face, f"huggingface-cli login --token {hugging_face}",
              f"huggingface-cli login --token {p('api_key')}"),
        Shape("gitlab_token", gitlab, f"git clone https://oauth2:{gitlab}@gitlab.com/acme/app.git",
              f"git clone https://oauth2:{p('gitlab_token')}@gitlab.com/acme/app.git"),
        Shape("basic_auth", basic, f'curl -H "Authorization: Basic {basic}" https://ci.example.com',
              f'curl -H "Authorization: Basic {p("basic_auth")}" https://ci.example.com'),
        Shape("password", pass_, f"export PGUSER=app PASS={pass_}", f"export PGUSER=app PASS={p('password')}"),
        Shape("password", pwd, f"db:\n  user: app\n  pwd: {pwd}", f"db:\n  user: app\n  pwd: {p('password')}"),
        Shape("password", quoted_pw, f'{{"user": "app", "passwd": "{quoted_pw}"}}',
              f'{{"user": "app", "passwd": "{p("password")}"}}'),
        Shape("password", pw, f"password={pw}", f"password={p('password')}"),
        Shape("secret", secret_key, f"SECRET_KEY: {secret_key}", f"SECRET_KEY: {p('secret')}"),
        Shape("secret", client_secret, f'{{"client_id": "web", "client_secret": "{client_secret}"}}',
              f'{{"client_id": "web", "client_secret": "{p("secret")}"}}'),
        Shape("secret", token, f"GITHUB_TOKEN={token} make release", f"GITHUB_TOKEN={p('secret')} make release"),
        Shape("secret", api_key, f"https://api.example.com/v2/items?api_key={api_key}&page=2",
              f"https://api.example.com/v2/items?api_key={p('secret')}&page=2"),
    ]


@pytest.mark.parametrize("shape", shapes(seed=1), ids=lambda s: s.text.split()[0][:24])
def test_each_shape_is_caught(shape: Shape) -> None:
    redacted = Redactor()(shape.text)
    assert redacted == shape.stored
    assert shape.secret not in redacted
    assert Redactor()(redacted) == redacted  # idempotent: a stored turn hashes the same again


# Text that looks like a secret of one of the shapes above, and is not one.
LOOKALIKES = [
    # passwords
    "Click 'password reset' and the password reset email arrives.",
    "the passphrase is in the vault",
    "bypass=true compass: north passport: renewed",
    "pass = get_pass() and PASS=$DB_PASS",
    # secrets, tokens, keys
    "max_tokens=4096, token_count: 512, tokens: 1200",
    "token = request.headers.get('Authorization')",
    '"api_key": "YOUR_API_KEY", "token": "<your token>", secret: true',
    "the key: a11y is short for accessibility",
    "client_secret=${CLIENT_SECRET} and secret_key=os.environ.get",
    "tokenizer.pad_token = tokenizer.eos_token",
    "token: 2024-05-01, secret: 12345678",
    # Stripe, Hugging Face, GitLab
    "Stripe keys start with sk_live_ or sk_test_; never commit an sk_live_... key",
    "sk_live_XXXXXXXXXXXXXXXXXXXXXXXX is the placeholder in their docs",
    "the ask_live_session and desk_test_results tables",
    "half_time, hf_hub_download and hf_transfer; the hf_ prefix marks a token",
    "hf_tokenizerconfigurationfileloaderclass",
    "glpat- tokens; glpat-xxxxxxxxxxxxxxxxxxxx in the GitLab docs",
    # JWTs and Basic auth
    "eyJhbGciOiJIUzI1NiJ9 is only a header; aGVsbG8.d29ybGQ.Zm9vYmFy is not a JWT",
    "eyJ0eXAi.notajwt.atall and version.eyJ.1",
    "HTTP Basic authentication; Basic auth is simple; basic dXNlcm5hbWU is one word",
    # AWS
    "aws_secret_access_key = <from the console>",
    "commit 3f7c2a9e1b4d6f8a0c2e4b6d8f0a2c4e6b8d0f2a touched the secret key docs",
    "AKIA is the prefix of access key ids; the secret access key is 40 characters",
]


@pytest.mark.parametrize("text", LOOKALIKES)
def test_lookalikes_are_kept(text: str) -> None:
    assert Redactor("secrets,cards")(text) == text


def test_a_text_that_lower_cases_longer_is_redacted_too() -> None:
    # "İ".lower() is two characters: offsets in the lower-cased text no longer match.
    shape = shapes(seed=2)[-3]
    assert Redactor()("İstanbul " + shape.text) == "İstanbul " + shape.stored


def _stored_contents(proxy: RunningProxy) -> list[str]:
    return [row[0] for row in db_rows(proxy, "SELECT content FROM turns")]


@pytest.mark.both_backends
def test_every_shape_is_stored_redacted_through_each_api_format(
    start_proxy: Starter, upstream: ScriptedUpstream, backend: str
) -> None:
    proxy = start_proxy(memory=True, anthropic_base_url=upstream.base_url.removesuffix("/v1"))
    all_shapes = shapes(seed=3)
    chats, rest = all_shapes[:-2], all_shapes[-2:]
    history: list[dict[str, str]] = []
    for i, shape in enumerate(chats):
        history.append({"role": "user", "content": shape.text})
        reply = chat(proxy, history, session="shapes", headers=ALICE, stream=i % 2 == 1)
        assert reply.status == 200 and "x-memory-error" not in reply.headers
        history.append({"role": "assistant", "content": reply.text})
    with openai.OpenAI(base_url=proxy.base_url, api_key="sk-test", max_retries=0) as client:
        client.responses.create(model="gpt-4o-mini", input=rest[0].text,
                                extra_headers={**ALICE, "X-Memory-Session-Id": "responses"})
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0) as claude:
        claude.messages.create(model="claude-scripted-1", max_tokens=64,
                               messages=[{"role": "user", "content": rest[1].text}],
                               extra_headers={**ALICE, "X-Memory-Session-Id": "messages"})
    # The upstream got every message as the client sent it.
    assert [r.json["messages"][-1]["content"] for r in upstream.history[:len(chats)]] == [
        s.text for s in chats]
    wait_for_jobs(proxy)

    with memory_api(proxy, **ALICE) as api:
        turns = api.get("/turns", params={"session_id": "shapes"}).json()["data"]
        others = [api.get("/turns", params={"session_id": s}).json()["data"][0]["content"]
                  for s in ("responses", "messages")]
    assert [t["content"] for t in turns[::2]] == [s.stored for s in chats]
    assert [reply["content"] for reply in turns[1::2]] == [f"echo: {s.stored}" for s in chats]
    assert others == [s.stored for s in rest]
    secrets = [s.secret for s in all_shapes]
    stored = "\n".join(_stored_contents(proxy))
    assert [s for s in secrets if s in stored] == []
    if backend == "sqlite":  # the file, its WAL and the vector index
        assert found_in(data_bytes(proxy), secrets) == []
