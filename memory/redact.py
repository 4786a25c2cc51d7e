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

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("secrets", "secrets,cards", "off")


def placeholder(kind: str) -> str:
    """The text a secret of this kind is replaced with."""
    return f"[REDACTED:{kind}]"


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    replace: Callable[[re.Match[str]], str]
    # Lower-case words a match starts with (its label: `password`, `bearer`, ...). The rule
    # runs only when the text holds one, and the pattern is tried only where one starts
    # (found with str.find): a case-insensitive pattern cannot skip ahead on a literal
    # prefix, and scanning for it cost 0.6 ms on 10 KB of chat that says "token" or "key".
    needles: tuple[str, ...] = ()

    def apply(self, text: str, lowered: str, starts_of: dict[str, list[int]]) -> str:
        """`text` with this rule's matches replaced (`text` itself when none is).

        `lowered` is `text.lower()`; `starts_of` caches where each needle starts in it."""
        if not self.needles:
            return self.pattern.sub(self.replace, text)
        starts: list[int] = []
        for needle in self.needles:
            if needle not in starts_of:
                starts_of[needle] = _find_all(lowered, needle)
            starts += starts_of[needle]
        if not starts:
            return text
        if len(lowered) != len(text):  # lower() lengthened a character: offsets differ
            return self.pattern.sub(self.replace, text)
        pieces: list[str] = []
        end = 0
        for start in sorted(starts):
            match = None if start < end else self.pattern.match(text, start)
            if match is not None and (replaced := self.replace(match)) != match.group(0):
                pieces += [text[end:start], replaced]
                end = match.end()
        return "".join([*pieces, text[end:]]) if pieces else text


def _find_all(text: str, needle: str) -> list[int]:
    found = []
    at = text.find(needle)
    while at >= 0:
        found.append(at)
        at = text.find(needle, at + 1)
    return found


def _whole(kind: str, *, needs_digit: bool = False) -> Callable[[re.Match[str]], str]:
    def replace(match: re.Match[str]) -> str:
        if needs_digit and not any(ch.isdigit() for ch in match.group(0)):
            return match.group(0)
        return placeholder(kind)

    return replace


def _value(kind: str, accept: Callable[[str], bool]) -> Callable[[re.Match[str]], str]:
    """Replace only group `value`, when `accept` says it is a secret."""

    def replace(match: re.Match[str]) -> str:
        value = match.group("value")
        if not accept(value):
            return match.group(0)
        start, end = match.span("value")
        offset = match.start()
        whole = match.group(0)
        return whole[: start - offset] + placeholder(kind) + whole[end - offset :]

    return replace


_CODE_LIKE = re.compile(r"[$%*]|^[A-Za-z_]+$|^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
# An unquoted value ends at space, quote, separator or bracket, and not on a full stop.
_UNQUOTED = r"""(?P<value>[^\s"',;(){}\[\]<>]{0,199}[^\s"',;(){}\[\]<>.:])"""


def _password_like(value: str) -> bool:
    """An unquoted value that looks like a password, not a word or a code expression."""
    return len(value) >= 3 and not _CODE_LIKE.search(value)


def _not_redacted(value: str) -> bool:
    """Not a placeholder an earlier rule put there (`://user:[REDACTED:github_token]@`)."""
    return not value.startswith("[REDACTED:")


def _token_like(value: str) -> bool:
    """A bearer token, not a lower-case word."""
    return not (value.isalpha() and value.islower())


def _mixed(value: str) -> bool:
    """At least two of upper case, lower case and digits: a random body, not a name."""
    return sum((any(c.isupper() for c in value), any(c.islower() for c in value),
                any(c.isdigit() for c in value))) >= 2


def _whole_if(kind: str, accept: Callable[[str], bool]) -> Callable[[re.Match[str]], str]:
    """Replace the whole match when `accept` says its group `body` is a secret."""

    def replace(match: re.Match[str]) -> str:
        return placeholder(kind) if accept(match.group("body")) else match.group(0)

    return replace


_DIGIT = re.compile(r"[0-9]")
_LETTER = re.compile(r"[A-Za-z]")


def _secret_like(value: str) -> bool:
    """A value after `token`/`secret`/`api_key`: random-looking, not a word, number or code."""
    return (
        len(value) >= 8 and _not_redacted(value) and _DIGIT.search(value) is not None
        and _LETTER.search(value) is not None and not _CODE_LIKE.search(value)
    )


def _basic_credentials(value: str) -> bool:
    """Base64 that decodes to `user:password` text, as HTTP Basic credentials do (RFC 7617)."""
    try:
        decoded = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return False
    return ":" in decoded and decoded.isprintable()


# Labels match in any case (they start with a character class rather than (?i), which is
# faster where offsets force the scanning fallback in _Rule.apply).
_PASSWORD_LABEL = r"[Pp](?i:ass(?:word|wd|phrase)|wd)\w*"
# Also a bare `pass` (PASS=, DB_PASS:), but not inside a word (bypass, passport, compass).
_ASSIGNED_PASSWORD = r"[Pp](?i:(?:ass(?:word|wd|phrase)|wd)\w*|(?<![A-Za-z].)ass(?![A-Za-z]))"
_PASSWORD_NEEDLES = ("pass", "pwd")
# A name ending in one of these holds a secret: client_secret, GITHUB_TOKEN, x-api-key. A
# match starts at secret, token or key (where str.find finds them); what owns the key is
# looked behind for, one fixed-width lookbehind per spelling.
_KEY_OWNERS = "|".join(
    f"(?<={word}{joint})" for word in ("api", "access", "private", "auth") for joint in ("", "_", "-")
)
_SECRET_LABEL = rf"(?:[Ss](?i:ecret(?:[_-]?key)?)|[Tt](?i:oken)|(?i:{_KEY_OWNERS})[Kk](?i:ey))"
_SECRET_NEEDLES = ("secret", "token", "key")
# A secret's value also ends at `&`: `?api_key=...&page=2` keeps its next parameter.
_SECRET_VALUE = _UNQUOTED.replace("<>", "<>&")
_QUOTED = r"""(?P<q>["'])(?P<value>[^"'\n]{1,200})(?P=q)"""
_SECRET_RULES = (
    # Each case-sensitive pattern starts with a literal (lookbehinds come after it) so the
    # regex engine skips ahead to candidates: about 20x faster than a leading lookbehind.
    _Rule(
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|[A-Za-z0-9+/=\s:,.-]*)",
            re.DOTALL,
        ),
        _whole("private_key"),
    ),
    _Rule(
        re.compile(r"sk-(?<![\w-]sk-)(?:proj-|ant-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),
        _whole("api_key", needs_digit=True),
    ),
    _Rule(
        re.compile(r"AIza(?<![\w-]AIza)[0-9A-Za-z_-]{35}(?![\w-])"), _whole("api_key")
    ),
    _Rule(
        re.compile(r"xox(?<![\w-]xox)[abposr]-[A-Za-z0-9-]{10,}"),
        _whole("api_key", needs_digit=True),
    ),
    _Rule(
        re.compile(r"g(?<![\w/]g)(?:h[pousr]_[A-Za-z0-9]{36,255}|ithub_pat_[A-Za-z0-9_]{22,255})"),
        _whole("github_token"),
    ),
    *(  # sk_live_..., rk_test_...: a documentation mention without a body is kept
        _Rule(
            re.compile(p + r"(?<![\w-]" + p + r")(?:live|test)_(?P<body>[0-9A-Za-z]{16,})(?![\w-])"),
            _whole_if("api_key", _mixed),
        )
        for p in ("sk_", "rk_")
    ),
    _Rule(  # Hugging Face: hf_ and 34 letters; hf_hub_download and half_time are names
        re.compile(r"hf_(?<![\w-]hf_)(?P<body>[A-Za-z0-9]{30,})(?![\w-])"),
        _whole_if("api_key", _mixed),
    ),
    _Rule(
        re.compile(r"glpat-(?<![\w-]glpat-)(?P<body>[A-Za-z0-9_-]{20,})(?![\w-])"),
        _whole_if("gitlab_token", _mixed),
    ),
    _Rule(  # aws_secret_access_key = ..., "SecretAccessKey": "...", AWS Secret Access Key [None]:
        re.compile(
            r"[Ss](?i:ecret(?:[\s_-]?access)?[\s_-]?key)(?:\s*\[[^\]\n]{0,40}\])?"
            r"""["']?\s*[:=]\s*["']?(?P<value>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])"""
        ),
        _value("aws_secret_key", _mixed), ("secret",),
    ),
    _Rule(  # the console's CSV and configure transcripts: the key id, then its secret
        re.compile(
            r"A(?<![A-Za-z0-9]A)(?:KIA|SIA)[A-Z0-9]{16}[\s,;:|\"']{1,6}"
            r"(?P<value>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])"
        ),
        _value("aws_secret_key", _mixed),
    ),
    _Rule(
        re.compile(
            r"A(?<![A-Za-z0-9]A)(?:KIA|SIA|BIA|CCA|GPA|IDA|ROA|IPA|NPA|NVA|PKA)"
            r"[A-Z0-9]{16}(?![A-Za-z0-9])"
        ),
        _whole("aws_access_key"),
    ),
    _Rule(
        re.compile(r"[Bb](?<!\w.)(?i:earer)\s+(?P<value>[A-Za-z0-9._~+/=-]{16,})"),
        _value("bearer_token", _token_like), ("bearer",),
    ),
    _Rule(  # a JWT's header and payload are base64url JSON objects: both start eyJ ('{"')
        re.compile(
            r"eyJ(?<![\w-]eyJ)[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*(?![\w-])"
        ),
        _whole("jwt"),
    ),
    _Rule(  # Authorization: Basic dXNlcjpwYXNz (only when it decodes to user:password)
        re.compile(r"[Bb](?<!\w.)(?i:asic)\s+(?P<value>[A-Za-z0-9+/]{4,}={0,2})(?![\w+/=])"),
        _value("basic_auth", _basic_credentials), ("basic",),
    ),
    _Rule(  # "password": "x", password='x': a quoted value is always a secret
        re.compile(_ASSIGNED_PASSWORD + r"""["']?\s*[:=]\s*""" + _QUOTED),
        _value("password", _not_redacted), _PASSWORD_NEEDLES,
    ),
    _Rule(  # password=x, PASS=x, PASSWORD: x
        re.compile(_ASSIGNED_PASSWORD + r"""["']?\s*[:=][ \t]*""" + _UNQUOTED),
        _value("password", _password_like), _PASSWORD_NEEDLES,
    ),
    _Rule(  # my password is x (not "the pass is valid")
        re.compile(_PASSWORD_LABEL + r"""["']?\s+(?:is|was)\s+""" + _UNQUOTED),
        _value("password", _password_like), _PASSWORD_NEEDLES,
    ),
    _Rule(  # SECRET_KEY=x, token: x, ?access_token=x, "client_secret": "x" (never with spaces)
        re.compile(_SECRET_LABEL + r"""["']?\s*[:=][ \t]*["']?""" + _SECRET_VALUE),
        _value("secret", _secret_like), _SECRET_NEEDLES,
    ),
    _Rule(  # scheme://user:password@host
        re.compile(r"://[^\s:/@]+:(?P<value>[^\s/@]{1,200})(?=@)"),
        _value("password", _not_redacted),
    ),
)

_CARD = re.compile(
    r"[2-6](?<![\d.-][2-6])(?:\d{12,18}"
    r"|\d{3}(?P<s>[ -])\d{4}(?P=s)\d{4}(?P=s)\d{1,7}"
    r"|(?<=3)\d{3}(?P<a>[ -])\d{6}(?P=a)\d{4,5})(?![\d-]|\.\d)"
)


def luhn_valid(digits: str) -> bool:
    """Whether a string of digits passes the Luhn checksum (ISO/IEC 7812-1)."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = match.group(0).replace(" ", "").replace("-", "")
    if 13 <= len(digits) <= 19 and luhn_valid(digits):
        return placeholder("card_number")
    return match.group(0)


_CARD_RULES = (_Rule(_CARD, _card),)


class Redactor:
    """Replaces secrets in text with typed placeholders; a no-op in mode `off`."""

    def __init__(self, mode: str = "secrets") -> None:
        if mode not in MODES:
            raise ValueError(f"redaction mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        rules: tuple[_Rule, ...] = () if mode == "off" else _SECRET_RULES
        self._rules = rules + (_CARD_RULES if "cards" in mode else ())

    @property
    def active(self) -> bool:
        """Whether any rule applies."""
        return bool(self._rules)

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
