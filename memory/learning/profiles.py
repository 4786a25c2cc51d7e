"""The user-authored profile and the consent that governs it.

A profile (structured fields plus free text) can only be written while the user's consent
is on, is recalled only while it is on, and revoking consent deletes the profile in the
same transaction that records the revocation (its vector follows by a queued job, and
recall never uses a vector without its row).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from memory.learning.facts import FactError, queue_sync
from memory.redact import keep, redact_fields
from memory.storage import profiles
from memory.storage.database import Database
from memory.storage.fts import owner_token

MAX_PROFILE_CHARS = 8000


class ConsentRequired(FactError):
    """The user has not given consent to keep a profile."""


@dataclass(frozen=True)
class Profile:
    """A user's profile."""

    user_id: str
    fields: dict[str, Any]
    text: str
    created_at: float
    updated_at: float

    def render(self) -> str:
        """The profile as text: `key: value` lines, then the free text."""
        lines = [f"{key}: {_value(value)}" for key, value in self.fields.items()]
        return "\n".join([*lines, self.text] if self.text else lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def profile_vector_id(user_id: str) -> str:
    """The profile's id in the vector index (`p` + the user's digits)."""
    return "p" + owner_token(user_id)[1:]


@dataclass(eq=False)
class ProfileStore:
    """Profiles and consent, per user."""

    db: Database
    _: KW_ONLY
    redact: Callable[[str], str] = keep
    notify: Callable[[], None] = lambda: None

    async def consent(self, user_id: str) -> bool:
        """Whether the user allows a profile to be kept and used (default: no)."""
        return await profiles.has_consent(self.db, user_id)

    async def set_consent(self, user_id: str, on: bool) -> None:
        """Give or revoke consent; revoking deletes the profile in the same transaction."""
        now = time.time()
        async with self.db.write() as tx:
            await profiles.set_consent(tx, user_id, on, now)
            if not on:
                await profiles.delete(tx, user_id)
                await queue_sync(tx, profiles=[user_id])
        if not on:
            self.notify()

    async def get(self, user_id: str) -> Profile | None:
        """The user's profile, or None."""
        found = await profiles.get(self.db, user_id)
        return None if found is None else Profile(user_id, *found)

    async def usable(self, user_id: str) -> Profile | None:
        """The profile if consent is on (what recall may use), else None."""
        return await self.get(user_id) if await profiles.has_consent(self.db, user_id) else None

    def redacted(self, fields: Mapping[str, Any], text: str) -> tuple[dict[str, Any], str]:
        """The fields and text as they are stored: secrets redacted like turns and facts."""
        return redact_fields(fields, self.redact), self.redact(text.strip())

    async def put(self, user_id: str, fields: Mapping[str, Any], text: str) -> Profile:
        """Write the whole profile, secrets redacted; needs consent (ConsentRequired otherwise)."""
        if not isinstance(fields, Mapping) or not all(isinstance(k, str) for k in fields):
            raise FactError("fields must be an object with string keys", "fields")
        if not isinstance(text, str):
            raise FactError("text must be a string", "text")
        if len(json.dumps(dict(fields), ensure_ascii=False)) + len(text) > MAX_PROFILE_CHARS:
            raise FactError(f"a profile is at most {MAX_PROFILE_CHARS} characters", "fields")
        fields, text = self.redacted(fields, text)
        now = time.time()
        async with self.db.write() as tx:
            if not await profiles.has_consent(tx, user_id):
                raise ConsentRequired("turn consent on before writing a profile", "consent")
            await profiles.put(tx, user_id, fields, text, now)
            await queue_sync(tx, profiles=[user_id])
        self.notify()
        profile = await self.get(user_id)
        assert profile is not None
        return profile

    async def delete(self, user_id: str) -> bool:
        """Delete the profile (consent stays as it is)."""
        async with self.db.write() as tx:
            deleted = await profiles.delete(tx, user_id)
            await queue_sync(tx, profiles=[user_id])
        self.notify()
        return deleted > 0


def _value(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
