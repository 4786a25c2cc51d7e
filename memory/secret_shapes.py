"""The shapes of secrets that redaction replaces (memory/redact.py), as rules.

Each rule is a pattern and what to put in place of a match. Rules that start at a label
(`password`, `bearer`, `authorization`) list it as a needle: the rule runs only where the
text holds one, found with str.find, which keeps redaction of ordinary chat cheap. The
table of shapes and what is kept is in memory/redact.py's docstring and docs/memory.md.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass


def placeholder(kind: str) -> str:
    """The text a secret of this kind is replaced with."""
    return f"[REDACTED:{kind}]"


@dataclass(frozen=True)
class Rule:
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


def _value(kind: str, accept: Callable[[str], bool]) -> Callable[[re.Match[str]], str]:
    """Replace only group `value`, when `accept` says it is a secret."""

    def replace(match: re.Match[str]) -> str:
        return _replaced(match, "value", kind) if accept(match.group("value")) else match.group(0)

    return replace


def _replaced(match: re.Match[str], group: str, kind: str) -> str:
    """The match with its group `group` replaced by the placeholder of `kind`."""
    whole, offset = match.group(0), match.start()
    start, end = match.span(group)
    return whole[: start - offset] + placeholder(kind) + whole[end - offset :]


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


def _any(value: str) -> bool:
    return True


def _has_digit(value: str) -> bool:
    return any(ch.isdigit() for ch in value)


def _whole(
    kind: str, accept: Callable[[str], bool] = _any, group: int | str = 0
) -> Callable[[re.Match[str]], str]:
    """Replace the whole match when `accept` says its group `group` is a secret."""

    def replace(match: re.Match[str]) -> str:
        return placeholder(kind) if accept(match.group(group)) else match.group(0)

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


def _prefixed(
    prefix: str, body: str, kind: str, accept: Callable[[str], bool] = _mixed
) -> Rule:
    """A token that starts with a fixed prefix (npm_, dckr_pat_, ...) and then a random
    body: the literal first, so the regex engine skips ahead to candidates; the body must
    look random (`accept`), so the prefix alone in documentation is kept."""
    literal = re.escape(prefix)
    return Rule(  # the prefix is its needle: text without it costs one str.find
        re.compile(rf"{literal}(?<![\w.-]{literal})(?P<body>{body})(?![\w-])"),
        _whole(kind, accept, "body"), (prefix.lower(),),
    )


def _hex(value: str) -> bool:
    return _has_digit(value) and any(c.isalpha() for c in value)


# Values an assignment holds that are not secrets: a variable, a template, a placeholder
# (YOUR_API_KEY, xxxx, ****), a literal of a language, or code (get_key(), settings.KEY).
_NOT_A_VALUE = re.compile(
    r"""^(?:[$%<{*]|\[REDACTED:)|^(?:none|null|nil|true|false|undefined|empty|required|optional)$
    |^[xX*.\-_]+$|^[A-Z_]*YOUR[A-Z_]*$|[()]|^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$""",
    re.IGNORECASE | re.VERBOSE,
)


def _assigned(value: str) -> bool:
    """A value after an env-style name (`MEMPROXY_ADMIN_KEY=...`): anything but the above."""
    return len(value) >= 3 and not _NOT_A_VALUE.search(value)


def _cli_password(value: str) -> bool:
    """A password given to a command (`sshpass -p x`): quoted, or not a plain word, so
    "sshpass -p with care" is kept."""
    if value[:1] in "'\"":
        return _assigned(value[1:-1])
    return _assigned(value) and not (value.isalpha() and value.islower())


def _credentials(value: str) -> bool:
    """The credentials of an Authorization header: random-looking, not a word or template."""
    return len(value) >= 8 and _mixed(value) and not _NOT_A_VALUE.search(value)


# An env-style name (upper case, digits, underscores) ending in a word that says it holds a
# secret. The match starts at that word (where str.find finds it); what comes before it is
# checked in `_env_assignment`. `AWS_SECRET_ACCESS_KEY=`, `MEMPROXY_API_KEYS=`,
# `PGPASSWORD=`, `NPM_TOKEN=`, `DB_PASS=`.
_ENV_WORDS = r"(?:KEYS?|TOKENS?|SECRETS?|PASSWORDS?|PASSWD|PASS|PWD|PASSPHRASE|CREDENTIALS?)"
_ENV_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
# Names that end in KEY and hold no secret: a table's or a cache's key.
_ENV_NOT_SECRET = ("PRIMARY_KEY", "FOREIGN_KEY", "SORT_KEY", "PARTITION_KEY", "CACHE_KEY",
                   "ROUTING_KEY", "SHARD_KEY", "HASH_KEY", "RANGE_KEY", "GROUP_KEY", "_ID_KEY")
_ENV_VALUE = (
    r"""(?:(?P<q>["'])(?P<qvalue>[^"'\n]{1,500})(?P=q)"""
    r"""|(?P<value>[^\s"'`]{0,499}[^\s"'`.,;:)\]]))"""
)


# The commands whose options above carry a password, found earlier on the option's line.
_MYSQL = re.compile(r"(?:^|[\s;|&(`/])(?:mysql|mariadb)[\w-]*[ \t]", re.MULTILINE)
_PASSWORD_ARG = re.compile(r"(?:^|[\s;|&(`/])(?:sshpass[ \t]*$|redis-cli[ \t])", re.MULTILINE)


def _on_command_line(
    command: re.Pattern[str], accept: Callable[[str], bool]
) -> Callable[[re.Match[str]], str]:
    """Replace group `value` of an option when `command` runs earlier on its line (within
    200 characters): `mysql -u app -pS3cret`, not `mkdir -p build`."""
    by_value = _value("password", accept)

    def replace(match: re.Match[str]) -> str:
        text, start = match.string, match.start()
        line_start = max(text.rfind("\n", 0, start) + 1, start - 200)
        if command.search(text, line_start, start) is None:
            return match.group(0)
        return by_value(match)

    return replace


def _secret_name(name: str, word: str) -> bool:
    """Whether an env-style name ending in `word` names a secret: `word` alone, after an
    underscore (`ADMIN_KEY`), or run together where no other word ends that way
    (`PGPASSWORD`, `APIKEY`, `AUTHTOKEN`; not `MONKEY` or `TURKEY`)."""
    if name == word or name[: -len(word)].endswith("_") or word.startswith("PASSW"):
        return True
    return name.endswith(("APIKEY", "AUTHKEY", "SECRETKEY", "ACCESSKEY", "AUTHTOKEN",
                          "ACCESSTOKEN", "APITOKEN"))


def _env_assignment(match: re.Match[str]) -> str:
    """`NAME=value` with an env-style NAME: the value replaced; `NAME: value` (YAML, a
    compose file) only when the value is quoted or ends its line, so prose is kept."""
    whole = match.group(0)
    text, start = match.string, match.start()
    name_start = start
    while name_start > 0 and text[name_start - 1] in _ENV_NAME_CHARS:
        name_start -= 1
    word = match.group("word")
    name = text[name_start:start] + word
    before = text[name_start - 1] if name_start > 0 else ""
    if (before.isalnum() or (before != "" and before in "._-$")
            or name.endswith(_ENV_NOT_SECRET) or not _secret_name(name, word)):
        return whole
    group = "qvalue" if match.group("qvalue") is not None else "value"
    value = match.group(group)
    if match.group("sep").startswith(":") and group == "value":
        rest = text[match.end():match.end() + 2]
        if rest[:1] not in ("", "\n", "\r"):
            return whole
    if not _assigned(value):
        return whole
    return _replaced(match, group, "password" if word.startswith(("PASS", "PWD")) else "secret")


# Labels match in any case (they start with a character class rather than (?i), which is
# faster where offsets force the scanning fallback in Rule.apply).
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
SECRET_RULES = (
    # Each case-sensitive pattern starts with a literal (lookbehinds come after it) so the
    # regex engine skips ahead to candidates: about 20x faster than a leading lookbehind.
    Rule(
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|[A-Za-z0-9+/=\s:,.-]*)",
            re.DOTALL,
        ),
        _whole("private_key"),
    ),
    Rule(
        re.compile(r"sk-(?<![\w-]sk-)(?:proj-|ant-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"),
        _whole("api_key", _has_digit),
    ),
    Rule(
        re.compile(r"AIza(?<![\w-]AIza)[0-9A-Za-z_-]{35}(?![\w-])"), _whole("api_key")
    ),
    Rule(
        re.compile(r"xox(?<![\w-]xox)[abposr]-[A-Za-z0-9-]{10,}"),
        _whole("api_key", _has_digit),
    ),
    Rule(
        re.compile(r"g(?<![\w/]g)(?:h[pousr]_[A-Za-z0-9]{36,255}|ithub_pat_[A-Za-z0-9_]{22,255})"),
        _whole("github_token"),
    ),
    *(  # sk_live_..., rk_test_...: a documentation mention without a body is kept
        Rule(
            re.compile(p + r"(?<![\w-]" + p + r")(?:live|test)_(?P<body>[0-9A-Za-z]{16,})(?![\w-])"),
            _whole("api_key", _mixed, "body"),
        )
        for p in ("sk_", "rk_")
    ),
    Rule(  # Hugging Face: hf_ and 34 letters; hf_hub_download and half_time are names
        re.compile(r"hf_(?<![\w-]hf_)(?P<body>[A-Za-z0-9]{30,})(?![\w-])"),
        _whole("api_key", _mixed, "body"),
    ),
    Rule(
        re.compile(r"glpat-(?<![\w-]glpat-)(?P<body>[A-Za-z0-9_-]{20,})(?![\w-])"),
        _whole("gitlab_token", _mixed, "body"),
    ),
    # memproxy's own key secrets (memory/admin/api_keys.py mints mp-<8 hex>_<43 base64url>)
    _prefixed("mp-", r"[0-9a-f]{8}_[A-Za-z0-9_-]{20,}", "memproxy_key", _any),
    *(_prefixed(prefix, r"[A-Za-z0-9_-]{20,}", "gitlab_token")  # runner, deploy, trigger, CI
      for prefix in ("glrt-", "gldt-", "glptt-", "glcbt-", "glimt-", "glft-", "glsoat-")),
    _prefixed("npm_", r"[A-Za-z0-9]{36}", "npm_token"),
    _prefixed("pypi-", r"AgE[A-Za-z0-9_-]{50,}", "api_key"),
    _prefixed("dckr_pat_", r"[A-Za-z0-9_-]{20,}", "api_key"),  # Docker Hub
    _prefixed("SG.", r"[A-Za-z0-9_-]{16,32}\.[A-Za-z0-9_-]{16,64}", "api_key"),  # SendGrid
    *(_prefixed(prefix, r"[a-fA-F0-9]{32}", "api_key", _hex)  # Shopify
      for prefix in ("shpat_", "shpss_", "shpca_", "shppa_")),
    *(_prefixed(prefix, r"[a-f0-9]{64}", "api_key", _hex)  # DigitalOcean
      for prefix in ("dop_v1_", "doo_v1_", "dor_v1_")),
    _prefixed("whsec_", r"[A-Za-z0-9+/=]{24,}", "api_key"),  # Stripe webhook signing
    _prefixed("xapp-", r"[0-9]-[A-Za-z0-9-]{20,}", "api_key"),  # Slack app-level tokens
    _prefixed("gsk_", r"[A-Za-z0-9]{40,}", "api_key"),  # Groq
    _prefixed("lin_api_", r"[A-Za-z0-9]{32,}", "api_key"),  # Linear
    _prefixed("r8_", r"[A-Za-z0-9]{32,}", "api_key"),  # Replicate
    _prefixed("ATATT3", r"[A-Za-z0-9_=-]{40,}", "api_key"),  # Atlassian
    _prefixed("key-", r"[a-f0-9]{32}", "api_key", _hex),  # Mailgun
    _prefixed("ya29.", r"[0-9A-Za-z_-]{20,}", "google_token"),  # OAuth access tokens
    _prefixed("1//0", r"[0-9A-Za-z_-]{30,}", "google_token"),  # OAuth refresh tokens
    Rule(  # a webhook URL is its own credential: the host stays, the path goes
        re.compile(r"hooks\.slack\.com/(?:services|workflows|triggers)/"
                   r"(?P<value>[A-Za-z0-9_-]{6,}(?:/[A-Za-z0-9_-]{6,}){1,3})"),
        _value("slack_webhook", _any), ("hooks.slack.com/",),
    ),
    Rule(
        re.compile(r"discord(?:app)?\.com/api/webhooks/(?P<value>[0-9]{5,}/[A-Za-z0-9_-]{20,})"),
        _value("discord_webhook", _any), ("discord",),
    ),
    Rule(  # Azure connection strings: AccountKey=...; SharedAccessKey=...; a SAS's sig=
        re.compile(r"[AaSs](?i:ccountkey|haredaccesskey|haredaccesssignature)\s*=\s*"
                   r"(?P<value>[A-Za-z0-9+/=%]{16,})"),
        _value("azure_key", _not_redacted), ("accountkey", "sharedaccess"),
    ),
    Rule(
        re.compile(r"sig=(?<=[?&;]sig=)(?P<value>[A-Za-z0-9%+/=]{20,})"),
        _value("azure_key", _mixed), ("sig=",),
    ),
    Rule(  # aws_secret_access_key = ..., "SecretAccessKey": "...", AWS Secret Access Key [None]:
        re.compile(
            r"[Ss](?i:ecret(?:[\s_-]?access)?[\s_-]?key)(?:\s*\[[^\]\n]{0,40}\])?"
            r"""["']?\s*[:=]\s*["']?(?P<value>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])"""
        ),
        _value("aws_secret_key", _mixed), ("secret",),
    ),
    Rule(  # the console's CSV and configure transcripts: the key id, then its secret
        re.compile(
            r"A(?<![A-Za-z0-9]A)(?:KIA|SIA)[A-Z0-9]{16}[\s,;:|\"']{1,6}"
            r"(?P<value>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])"
        ),
        _value("aws_secret_key", _mixed),
    ),
    Rule(
        re.compile(
            r"A(?<![A-Za-z0-9]A)(?:KIA|SIA|BIA|CCA|GPA|IDA|ROA|IPA|NPA|NVA|PKA)"
            r"[A-Z0-9]{16}(?![A-Za-z0-9])"
        ),
        _whole("aws_access_key"),
    ),
    Rule(
        re.compile(r"[Bb](?<!\w.)(?i:earer)\s+(?P<value>[A-Za-z0-9._~+/=-]{16,})"),
        _value("bearer_token", _token_like), ("bearer",),
    ),
    Rule(  # a JWT's header and payload are base64url JSON objects: both start eyJ ('{"')
        re.compile(
            r"eyJ(?<![\w-]eyJ)[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*(?![\w-])"
        ),
        _whole("jwt"),
    ),
    Rule(  # Authorization: Basic dXNlcjpwYXNz (only when it decodes to user:password)
        re.compile(r"[Bb](?<!\w.)(?i:asic)\s+(?P<value>[A-Za-z0-9+/]{4,}={0,2})(?![\w+/=])"),
        _value("basic_auth", _basic_credentials), ("basic",),
    ),
    Rule(  # Authorization: Token x, Digest ..., ApiKey x, a bare x (any scheme, or none)
        re.compile(r"[Aa](?i:uthorization)[\"']?\s*[:=]\s*[\"']?"
                   r"(?:(?P<scheme>[A-Za-z][A-Za-z0-9-]{0,20})\s+)?"
                   r"(?P<value>[A-Za-z0-9._~+/=:-]{8,})"),
        _value("auth_credentials", _credentials), ("authorization",),
    ),
    Rule(  # mysql -pPASSWORD, mysqldump -p'...', mariadb -p"..." (no space: -p alone prompts)
        re.compile(r"-p(?<=[ \t]-p)(?P<value>\"[^\"\n]+\"|'[^'\n]+'|[^\s'\"]+)"),
        _on_command_line(_MYSQL, _assigned), ("-p",),
    ),
    Rule(  # sshpass -p x, redis-cli -a x
        re.compile(r"(?:-p(?<=[ \t]-p)|-a(?<=[ \t]-a)|--pass(?<=[ \t]--pass))[ \t]+"
                   r"(?P<value>\"[^\"\n]+\"|'[^'\n]+'|[^\s'\"]+)"),
        _on_command_line(_PASSWORD_ARG, _cli_password), ("-p", "-a", "--pass"),
    ),
    Rule(  # MEMPROXY_ADMIN_KEY=..., export NPM_TOKEN="...", PGPASSWORD=..., DB_PASS: ...
        re.compile(rf"(?P<word>{_ENV_WORDS})(?![A-Z0-9_])[\"']?(?P<sep>[ \t]*=[ \t]*|:[ \t]*)"
                   + _ENV_VALUE),
        _env_assignment, ("key", "token", "secret", "pass", "pwd", "credential"),
    ),
    Rule(  # "password": "x", password='x': a quoted value is always a secret
        re.compile(_ASSIGNED_PASSWORD + r"""["']?\s*[:=]\s*""" + _QUOTED),
        _value("password", _not_redacted), _PASSWORD_NEEDLES,
    ),
    Rule(  # password=x, PASS=x, PASSWORD: x
        re.compile(_ASSIGNED_PASSWORD + r"""["']?\s*[:=][ \t]*""" + _UNQUOTED),
        _value("password", _password_like), _PASSWORD_NEEDLES,
    ),
    Rule(  # my password is x (not "the pass is valid")
        re.compile(_PASSWORD_LABEL + r"""["']?\s+(?:is|was)\s+""" + _UNQUOTED),
        _value("password", _password_like), _PASSWORD_NEEDLES,
    ),
    Rule(  # SECRET_KEY=x, token: x, ?access_token=x, "client_secret": "x" (never with spaces)
        re.compile(_SECRET_LABEL + r"""["']?\s*[:=][ \t]*["']?""" + _SECRET_VALUE),
        _value("secret", _secret_like), _SECRET_NEEDLES,
    ),
    Rule(  # scheme://user:password@host
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


CARD_RULES = (Rule(_CARD, _card),)
