"""Secret redaction for stored memory (`MEMPROXY_REDACT`).

Applied to text before it is stored: turns (and so their chunks, full-text and vector
indexes, and the facts and summaries learned from them), manual and imported facts and
summaries, and profiles (their text and every string in their fields). What is forwarded to the upstream is never changed. Each secret becomes a typed
placeholder such as `[REDACTED:api_key]`, so a recalled turn still says a key was there.

    kind            what
    private_key     PEM private key blocks (also one cut off before its END line)
    api_key         sk-..., sk-proj-..., sk-ant-... keys; Google AIza... keys; Slack xox?- tokens;
                    Stripe sk_live_/sk_test_/rk_live_/rk_test_ keys; Hugging Face hf_ tokens
    github_token    ghp_/gho_/ghu_/ghs_/ghr_ tokens and github_pat_ tokens
    gitlab_token    glpat- personal access tokens
    aws_access_key  AWS access key ids (AKIA..., ASIA..., ...)
    aws_secret_key  the 40-character secret after `aws_secret_access_key =`, `SecretAccessKey:`,
                    `AWS Secret Access Key [None]:`, or next to an access key id (the console's CSV)
    jwt             JSON Web Tokens: eyJ<header>.eyJ<payload>.<signature>
    bearer_token    the token after `Bearer ` (Authorization headers, curl lines)
    basic_auth      the credentials after `Basic ` when they decode to `user:password`
    password        `password=...`, `PASS=...`, `pwd: ...`, `"passwd": "..."`, `password is ...`,
                    and the password in `scheme://user:password@host`
    secret          the value of `secret`, `client_secret`, `secret_key`, `token`, `api_key`,
                    `access_key`, `private_key`, `auth_key` (any prefix: `GITHUB_TOKEN=...`) in
                    `key=value`, `key: value` and `"key": "value"` forms
    card_number     13-19 digit Luhn-valid card numbers (mode `secrets,cards` only)

The patterns favour few false positives on prose and code: a key needs a digit in its body;
an unquoted password must hold more than letters and must not look like a code expression
(`password=password`, `password=get_pw()`, `$PASSWORD` are kept); a card number must pass
Luhn and start like one (2-6), which spares millisecond timestamps and most ids. A value
after `secret`/`token`/`api_key` (quoted or not) must look random: 8 or more characters, no
spaces, letters and digits, not a code expression (`max_tokens=4096`, `token=get_token()`,
`"api_key": "YOUR_API_KEY"` are kept). Prefixed tokens (Stripe, Hugging Face, GitLab) need a
body of mixed character classes, so `sk_live_` in documentation and `hf_hub_download` are kept.
The README's table of shapes lists an example of each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from memory.secret_shapes import CARD_RULES, SECRET_RULES, Rule, luhn_valid, placeholder

__all__ = ["MODES", "Redactor", "keep", "luhn_valid", "placeholder", "redact_fields",
           "redact_record"]

MODES = ("secrets", "secrets,cards", "off")


class Redactor:
    """Replaces secrets in text with typed placeholders; a no-op in mode `off`."""

    def __init__(self, mode: str = "secrets") -> None:
        if mode not in MODES:
            raise ValueError(f"redaction mode must be one of {', '.join(MODES)}, got {mode!r}")
        rules: tuple[Rule, ...] = () if mode == "off" else SECRET_RULES
        self._rules = rules + (CARD_RULES if "cards" in mode else ())

    def __call__(self, text: str) -> str:
        """`text` with every secret replaced."""
        if not self._rules:
            return text
        lowered = text.lower()
        starts_of: dict[str, list[int]] = {}
        for rule in self._rules:
            changed = rule.apply(text, lowered, starts_of)
            if changed != text:
                text, lowered, starts_of = changed, changed.lower(), {}
        return text


def keep(text: str) -> str:
    """The identity redaction: text stored verbatim."""
    return text


def redact_record(record: Mapping[str, Any], redact: Callable[[str], str]) -> dict[str, Any]:
    """A fact or summary import record with its `text` (and a summary's `data`) redacted."""
    copy = dict(record)
    copy["text"] = redact(record["text"])
    data = record.get("data")
    if isinstance(data, Mapping):
        copy["data"] = {key: [redact(str(v)) for v in values] for key, values in data.items()}
    return copy


def redact_profile(body: Mapping[str, Any], redact: Callable[[str], str]) -> dict[str, Any]:
    """A profile's JSON view (`Profile.as_dict`) with its text and fields redacted."""
    return {**body, "text": redact(str(body["text"])),
            "fields": redact_fields(body["fields"], redact)}


def redact_fields(fields: Mapping[str, Any], redact: Callable[[str], str]) -> dict[str, Any]:
    """Profile fields with every string inside redacted (keys too). A value is read with its
    key, as the profile renders it: `{"password": "..."}` is redacted as `password: ...` is."""
    return {redact(key): _field_value(key, value, redact) for key, value in fields.items()}


def _field_value(key: str, value: Any, redact: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        said = f"{key}: {value}"
        kept = redact(said)
        if kept != said and kept.startswith(f"{key}: "):
            return kept[len(key) + 2 :]
        return redact(value)
    if isinstance(value, list):
        return [_field_value(key, item, redact) for item in value]
    if isinstance(value, Mapping):
        return redact_fields(value, redact)
    return value
