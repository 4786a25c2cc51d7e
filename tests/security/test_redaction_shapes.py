"""Secret shapes redaction catches (memory/redact.py), each tested both ways: a secret in
that shape is replaced by its placeholder, and ordinary text that looks like it is kept.

The end-to-end test sends every shape through memproxy (chat completions whole and
streamed, Responses, Messages) and reads what was stored, on both storage backends.
"""

from __future__ import annotations

import base64
import json
import random
import string
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

from memory.redact import Redactor, placeholder
from tests.conftest import RunningProxy
from tests.support.chat import chat
from tests.support.jobs import wait_for_jobs
from tests.support.mcp_client import mcp_session, structured
from tests.support.memory import db_rows, export_records, memory_api
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.scripted_upstream import ScriptedUpstream
from tests.support.tracing import collecting
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


# -- issue 37, item 7: memproxy's own secrets, env-style assignments, more services' tokens


def issue37_shapes(seed: int) -> list[Shape]:
    """One message per shape the second security review found stored verbatim, and the
    common shapes beside them, with secrets made up afresh."""
    rng = random.Random(seed)
    p = placeholder
    mp_key = f"mp-{rng.getrandbits(32):08x}_" + _random(rng, B64URL, 43)
    admin, env_list = _random(rng, ALNUM, 24), f"{_random(rng, ALNUM, 16)}:alice,{_random(rng, ALNUM, 16)}:bob"
    letters = "".join(rng.choice(LOWER) for _ in range(14))  # a password of letters only
    npm = "npm_" + _random(rng, ALNUM, 36)
    slack = f"T{_random(rng, UPPER + DIGITS, 8)}/B{_random(rng, UPPER + DIGITS, 10)}/{_random(rng, ALNUM, 24)}"
    discord = f"{rng.randrange(10**17, 10**18)}/{_random(rng, B64URL, 68)}"
    account_key = _random(rng, ALNUM + "+/", 86) + "=="
    shared_key = _random(rng, ALNUM + "+/", 43) + "="
    sas = _random(rng, ALNUM, 40) + "%3D"
    ya29 = "ya29." + _random(rng, B64URL, 60)
    refresh = "1//0" + _random(rng, B64URL, 40)
    drf, api_key_scheme, short_bearer = (_random(rng, LOWER + DIGITS, 40), _random(rng, ALNUM, 32),
                                         _random(rng, ALNUM, 12))
    mysql, dump, ssh, redis = (_random(rng, ALNUM, 12) + "!" for _ in range(4))
    glrt, whsec = "glrt-" + _random(rng, B64URL, 20), "whsec_" + _random(rng, ALNUM, 32)
    docker, pypi = "dckr_pat_" + _random(rng, B64URL, 27), "pypi-AgEIcHlwaS5vcmc" + _random(rng, B64URL, 60)
    sendgrid = f"SG.{_random(rng, B64URL, 22)}.{_random(rng, B64URL, 43)}"
    digital = "dop_v1_" + "".join(rng.choice("0123456789abcdef") for _ in range(62)) + "a1"
    shopify = "shpat_" + "".join(rng.choice("0123456789abcdef") for _ in range(30)) + "b2"
    pgpass, yaml_pw, py_key = _random(rng, ALNUM, 14), _random(rng, ALNUM, 14), _random(rng, ALNUM, 20)
    return [
        Shape("memproxy_key", mp_key, f"my memproxy key is {mp_key}, from the admin",
              f"my memproxy key is {p('memproxy_key')}, from the admin"),
        Shape("memproxy_key", mp_key, f"OPENAI_API_KEY={mp_key} aider", f"OPENAI_API_KEY={p('memproxy_key')} aider"),
        Shape("secret", admin, f"MEMPROXY_ADMIN_KEY={admin} memproxy serve",
              f"MEMPROXY_ADMIN_KEY={p('secret')} memproxy serve"),
        Shape("secret", env_list, f"export MEMPROXY_API_KEYS={env_list}\n",
              f"export MEMPROXY_API_KEYS={p('secret')}\n"),
        Shape("secret", letters, f'docker run -e MEMPROXY_ADMIN_KEY="{letters}" memproxy',
              f'docker run -e MEMPROXY_ADMIN_KEY="{p("secret")}" memproxy'),
        Shape("secret", letters, f"environment:\n  SENTRY_AUTH_TOKEN: {letters}\n",
              f"environment:\n  SENTRY_AUTH_TOKEN: {p('secret')}\n"),
        Shape("secret", py_key, f'STRIPE_WEBHOOK_SECRET = "{py_key}"', f'STRIPE_WEBHOOK_SECRET = "{p("secret")}"'),
        Shape("password", pgpass, f"PGPASSWORD={pgpass} psql -h db app", f"PGPASSWORD={p('password')} psql -h db app"),
        Shape("password", letters, f"DB_PASSWORD={letters}", f"DB_PASSWORD={p('password')}"),
        Shape("password", yaml_pw, f"db:\n  MYSQL_ROOT_PASSWORD: '{yaml_pw}'",
              f"db:\n  MYSQL_ROOT_PASSWORD: '{p('password')}'"),
        Shape("npm_token", npm, f"//registry.npmjs.org/:_authToken={npm}",
              f"//registry.npmjs.org/:_authToken={p('npm_token')}"),
        Shape("npm_token", npm, f"npm token: {npm}.", f"npm token: {p('npm_token')}."),
        Shape("slack_webhook", slack, f"curl -X POST https://hooks.slack.com/services/{slack} -d @msg.json",
              f"curl -X POST https://hooks.slack.com/services/{p('slack_webhook')} -d @msg.json"),
        Shape("discord_webhook", discord, f"https://discord.com/api/webhooks/{discord}",
              f"https://discord.com/api/webhooks/{p('discord_webhook')}"),
        Shape("azure_key", account_key,
              f"DefaultEndpointsProtocol=https;AccountName=acme;AccountKey={account_key};EndpointSuffix=core.windows.net",
              f"DefaultEndpointsProtocol=https;AccountName=acme;AccountKey={p('azure_key')};EndpointSuffix=core.windows.net"),
        Shape("azure_key", shared_key,
              f"Endpoint=sb://acme.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey={shared_key}",
              f"Endpoint=sb://acme.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey={p('azure_key')}"),
        Shape("azure_key", sas, f"https://acme.blob.core.windows.net/c/f.txt?sv=2022-11-02&sp=r&sig={sas}",
              f"https://acme.blob.core.windows.net/c/f.txt?sv=2022-11-02&sp=r&sig={p('azure_key')}"),
        Shape("google_token", ya29, f"access token {ya29} from gcloud", f"access token {p('google_token')} from gcloud"),
        Shape("google_token", refresh, f'"refresh_token": "{refresh}"', f'"refresh_token": "{p("google_token")}"'),
        Shape("auth_credentials", drf, f'curl -H "Authorization: Token {drf}" https://api.example.com/',
              f'curl -H "Authorization: Token {p("auth_credentials")}" https://api.example.com/'),
        Shape("auth_credentials", api_key_scheme, f"authorization: ApiKey {api_key_scheme}",
              f"authorization: ApiKey {p('auth_credentials')}"),
        Shape("auth_credentials", short_bearer, f"Authorization: Bearer {short_bearer}",
              f"Authorization: Bearer {p('auth_credentials')}"),
        Shape("password", mysql, f"mysql -h db -u root -p{mysql} app", f"mysql -h db -u root -p{p('password')} app"),
        Shape("password", dump, f"mysqldump -uroot -p'{dump}' app > app.sql", f"mysqldump -uroot -p{p('password')} app > app.sql"),
        Shape("password", ssh, f"sshpass -p {ssh} ssh deploy@web1", f"sshpass -p {p('password')} ssh deploy@web1"),
        Shape("password", redis, f"redis-cli -h cache -a {redis} ping", f"redis-cli -h cache -a {p('password')} ping"),
        Shape("gitlab_token", glrt, f"gitlab-runner register --token {glrt}",
              f"gitlab-runner register --token {p('gitlab_token')}"),
        Shape("api_key", whsec, f"the webhook secret {whsec}", f"the webhook secret {p('api_key')}"),
        Shape("api_key", docker, f"docker login -u acme -p {docker}", f"docker login -u acme -p {p('api_key')}"),
        Shape("api_key", pypi, f"password = {pypi}", f"password = {p('api_key')}"),
        Shape("api_key", sendgrid, f"SendGrid: {sendgrid}", f"SendGrid: {p('api_key')}"),
        Shape("api_key", digital, f"doctl auth init -t {digital}", f"doctl auth init -t {p('api_key')}"),
        Shape("api_key", shopify, f"X-Shopify-Access-Token: {shopify}", f"X-Shopify-Access-Token: {p('api_key')}"),
    ]


@pytest.mark.parametrize("shape", issue37_shapes(seed=11), ids=lambda s: s.text.split()[0][:24])
def test_each_issue37_shape_is_caught(shape: Shape) -> None:
    redacted = Redactor()(shape.text)
    assert redacted == shape.stored
    assert shape.secret not in redacted
    assert Redactor()(redacted) == redacted


@pytest.mark.parametrize("seed", range(20, 30))
def test_each_issue37_shape_is_caught_with_other_secrets(seed: int) -> None:
    for shape in issue37_shapes(seed):
        assert shape.secret not in Redactor()(shape.text), shape.text


def test_issue37_shapes_in_one_message_are_each_caught() -> None:
    found = issue37_shapes(seed=15)
    redacted = Redactor()("\n".join(s.text for s in found))
    assert redacted == "\n".join(s.stored for s in found)


ISSUE37_LOOKALIKES = [
    "the PRIMARY_KEY=id column, SORT_KEY=created_at and PARTITION_KEY=tenant",
    "OPENAI_API_KEY=YOUR_API_KEY, API_KEY=<your key>, TOKEN=$TOKEN, NPM_TOKEN=${NPM_TOKEN}",
    "SECRET_KEY=os.environ.get('SECRET_KEY') or ADMIN_KEY=settings.ADMIN_KEY",
    "GITHUB_TOKEN: ${{ secrets.GITHUB_TOKEN }}",
    "MEMPROXY_ADMIN_KEY: the admin key, for the admin API only",
    "Set MEMPROXY_API_KEYS to a comma-separated list; MEMPROXY_API_KEYS= (empty) means none.",
    "MONKEY=banana TURKEY=roast WHISKEY=rye",
    "API_KEY=None, AUTH_TOKEN=null, SECRET=xxxxxxxx, PASSWORD=********",
    "x = os.environ[\"MY_TOKEN\"]; MY_TOKEN is read at start",
    "mysql -p app prompts; mysql -P 3306 -h db; mysqldump --port=3306 -p",
    "mkdir -p build && ls -a && cp -p a b",
    "use sshpass -p with care; redis-cli -a is deprecated",
    "Authorization: required. The Authorization header; Authorization: Bearer <token>",
    "Authorization: Token YOUR_TOKEN and authorization: basic auth",
    "ya29. is the prefix of Google access tokens; npm_config_cache, npm_package_version",
    "post to https://hooks.slack.com/services/... with a JSON body",
    "a key-value store; key-0123; SG.1; the sig= parameter of a SAS URL",
    "AccountKey=<your key>; the mp- prefix; mp-1a2b3c4d is a prefix, not a key",
    "shpat_ and dop_v1_ and dckr_pat_ are prefixes; whsec_ too",
]


@pytest.mark.parametrize("text", ISSUE37_LOOKALIKES)
def test_issue37_lookalikes_are_kept(text: str) -> None:
    assert Redactor("secrets,cards")(text) == text


MCP_KEY = {"X-Memory-User-Id": "alice"}


@pytest.mark.both_backends
async def test_issue37_shapes_are_stored_exported_and_listed_redacted(
    start_proxy: Starter, backend: str
) -> None:
    """Turns, a fact added over MCP, the export and MCP list_memories: none holds a secret."""
    proxy = start_proxy(memory=True)
    found = issue37_shapes(seed=12)
    said = [{"role": "user", "content": "\n".join(s.text for s in found)}]
    assert chat(proxy, said, session="keys", headers=ALICE).status == 200
    assert chat(proxy, said, session="keys-streamed", headers=ALICE, stream=True).status == 200
    async with mcp_session(proxy, headers=MCP_KEY) as client:
        added = structured(await client.call_tool(
            "add_memory", {"text": f"User's memproxy key is {found[0].secret}, admin is "
                                   f"MEMPROXY_ADMIN_KEY={found[2].secret}"}))
        listed = structured(await client.call_tool("list_memories", {"limit": 5}))
    wait_for_jobs(proxy)
    secrets = [s.secret for s in found]
    shown = json.dumps([added, listed]) + json.dumps(export_records(proxy, **ALICE))
    assert [s for s in secrets if s in shown] == []
    assert placeholder("memproxy_key") in json.dumps(listed)
    stored = "\n".join(str(row) for row in db_rows(proxy, "SELECT content FROM turns"))
    stored += "\n".join(str(row) for row in db_rows(proxy, "SELECT text FROM facts"))
    assert [s for s in secrets if s in stored] == []
    if backend == "sqlite":
        assert found_in(data_bytes(proxy), secrets) == []


@pytest.mark.both_backends
async def test_text_stored_unredacted_leaves_redacted_through_export_and_mcp(
    start_proxy: Starter, backend: str
) -> None:
    """A turn, a fact and a profile stored while redaction was off (or before a shape was
    known) are redacted on the way out: the export, the memory API's reads and MCP's
    listings and profile resource, a search and a dry run run the redactor again."""
    mp_key = issue37_shapes(seed=13)[0].secret
    before = start_proxy(memory=True, redact="off")
    assert chat(before, f"the key is {mp_key}", session="old", headers=ALICE).status == 200
    async with mcp_session(before, headers=MCP_KEY) as client:
        structured(await client.call_tool("add_memory", {"text": f"User's key is {mp_key}"}))
    with memory_api(before, **ALICE) as api:
        assert api.put("/consent", json={"consent": True}).status_code == 200
        assert api.put("/profile", json={"fields": {"deploy key": mp_key},
                                         "text": f"Deploys with {mp_key}"}).status_code == 200
    wait_for_jobs(before)
    before.stop()
    proxy = start_proxy(memory=True)  # the same data directory and database
    assert mp_key in str(db_rows(proxy, "SELECT content FROM turns"))  # stored verbatim
    records = export_records(proxy, **ALICE)
    async with mcp_session(proxy, headers=MCP_KEY) as client:
        listed = structured(await client.call_tool("list_memories", {}))
        searched = structured(await client.call_tool("search_memory", {"query": "key", "scope": "user"}))
        profile = (await client.read_resource("memproxy://profile")).contents
    with memory_api(proxy, **ALICE) as api:
        facts = api.get("/facts").json()
        fact = api.get(f"/facts/{facts['data'][0]['id']}").json()
        turns = api.get("/turns", params={"session_id": "old"}).json()
        profile_read = api.get("/profile").json()
        found = api.post("/search", json={"query": "what is the key", "scope": "user"}).json()
    async with httpx.AsyncClient(timeout=30) as http:
        dry = (await http.post(f"{proxy.base_url}/chat/completions", headers={
            **ALICE, "X-Memory-Dry-Run": "on", "X-Memory-Scope": "user"}, json={
            "model": "gpt-4o", "messages": [{"role": "user", "content": "what is the key"}]})).json()
    assert [r for r in records if r["type"] == "turn"] and [r for r in records if r["type"] == "fact"]
    assert facts["data"] and turns["data"] and profile_read["profile"]
    assert found["items"] and dry["items"], (found, dry)  # the key's turn and fact are recalled
    shown = json.dumps([records, listed, searched["items"], facts, fact, turns, profile_read,
                        [c.model_dump() for c in profile], found, dry])
    assert mp_key not in shown and placeholder("memproxy_key") in shown


def test_captured_message_contents_on_a_span_are_redacted(
    monkeypatch: pytest.MonkeyPatch, start_proxy: Starter,
) -> None:
    """With content capture on, the GenAI span's input and output messages hold no secret
    (proxy/upstream/captured_messages.py), for text and for content parts, streamed or not."""
    found = issue37_shapes(seed=14)
    text = "\n".join(s.text for s in found)
    # The test process's provider (tests/support/tracing.py), as the other in-process
    # tracing tests: memproxy uses a provider set first, and one it set itself would stay
    # the process's for every later test.
    with OtlpReceiver() as collector, collecting(collector.endpoint):
        monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
        proxy = start_proxy()
        with openai.OpenAI(base_url=proxy.base_url, api_key="sk-test", max_retries=0) as client:
            client.chat.completions.create(model="gpt-4o-mini", messages=[
                {"role": "user", "content": text}])
            stream = client.chat.completions.create(model="gpt-4o-mini", stream=True, messages=[
                {"role": "user", "content": [{"type": "text", "text": text}]}])
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        calls = collector.wait_for(lambda s: s.kind == "CLIENT", count=2)
    for call in calls:
        sent = call.attributes["gen_ai.input.messages"]
        said = call.attributes["gen_ai.output.messages"]
        assert placeholder("memproxy_key") in sent and placeholder("memproxy_key") in said
    everything = json.dumps([s.attributes for s in collector.spans])
    assert [s.secret for s in found if s.secret in everything] == []
