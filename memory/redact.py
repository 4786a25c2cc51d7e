"""Secret redaction for stored memory (`MEMPROXY_REDACT`).

Applied to text before it is stored: turns (and so their chunks, full-text and vector
indexes, and the facts and summaries learned from them), manual and imported facts and
summaries, and profiles (their text and every string in their fields). What is forwarded to the upstream is never changed. Each secret becomes a typed
placeholder such as `[REDACTED:api_key]`, so a recalled turn still says a key was there.

    kind            what
    private_key     PEM private key blocks (also one cut off before its END line)
    api_key         sk-..., sk-proj-..., sk-ant-... keys; Google AIza... keys; Slack xox?- tokens
    github_token    ghp_/gho_/ghu_/ghs_/ghr_ tokens and github_pat_ tokens
    aws_access_key  AWS access key ids (AKIA..., ASIA..., ...)
    bearer_token    the token after `Bearer ` (Authorization headers, curl lines)
    password        `password=...`, `password: ...`, `"password": "..."`, `password is ...`,
                    and the password in `scheme://user:password@host`
    card_number     13-19 digit Luhn-valid card numbers (mode `secrets,cards` only)

The patterns favour few false positives on prose and code: a key needs a digit in its body;
an unquoted password must hold more than letters and must not look like a code expression
(`password=password`, `password=get_pw()`, `$PASSWORD` are kept); a card number must pass
Luhn and start like one (2-6), which spares millisecond timestamps and most ids.
"""

from __future__ import annotations

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
    # Lower-case words the text must hold for the rule to run at all: a cheap test that
    # spares the case-insensitive patterns, which cannot skip ahead on a literal prefix.
    needles: tuple[str, ...] = ()


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


_PASSWORD_LABEL = r"(?:pass(?:word|wd|phrase)|pwd)\w*"
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
    _Rule(
        re.compile(
            r"A(?<![A-Za-z0-9]A)(?:KIA|SIA|BIA|CCA|GPA|IDA|ROA|IPA|NPA|NVA|PKA)"
            r"[A-Z0-9]{16}(?![A-Za-z0-9])"
        ),
        _whole("aws_access_key"),
    ),
    _Rule(
        re.compile(r"(?i)bearer(?<!\wbearer)\s+(?P<value>[A-Za-z0-9._~+/=-]{16,})"),
        _value("bearer_token", _token_like), ("bearer",),
    ),
    _Rule(  # "password": "x", password='x': a quoted value is always a secret
        re.compile(
            _PASSWORD_LABEL
            + r"""["']?\s*[:=]\s*(?P<q>["'])(?P<value>[^"'\n]{1,200})(?P=q)""",
            re.IGNORECASE,
        ),
        _value("password", _not_redacted), ("pass", "pwd"),
    ),
    _Rule(  # password=x, PASSWORD: x, my password is x
        re.compile(
            _PASSWORD_LABEL + r"""["']?(?:\s*[:=][ \t]*|\s+(?:is|was)\s+)""" + _UNQUOTED,
            re.IGNORECASE,
        ),
        _value("password", _password_like), ("pass", "pwd"),
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
        for rule in self._rules:
            if rule.needles:
                for needle in rule.needles:
                    if needle in lowered:
                        break
                else:
                    continue
            text = rule.pattern.sub(rule.replace, text)
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
