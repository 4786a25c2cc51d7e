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
from dataclasses import dataclass
from typing import Any

from memory.facts import FactError, queue_sync
from memory.redact import redact_fields
from memory.store import Store, owner_token

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


class ProfileStore:
    """Profiles and consent, per user."""

    def __init__(self, store: Store, *, notify: Callable[[], None] | None = None) -> None:
        self.store = store
        self._notify = notify or (lambda: None)

    async def consent(self, user_id: str) -> bool:
        """Whether the user allows a profile to be kept and used (default: no)."""
        rows = await self.store.read("SELECT profile FROM consent WHERE user_id = ?", (user_id,))
        return bool(rows and rows[0][0])

    async def set_consent(self, user_id: str, on: bool) -> None:
        """Give or revoke consent; revoking deletes the profile in the same transaction."""
        now = time.time()
        async with self.store.write() as tx:
            await tx.change(
                "INSERT INTO consent (user_id, profile, updated_at) VALUES (?, ?, ?)"
                " ON CONFLICT (user_id) DO UPDATE SET profile = excluded.profile,"
                " updated_at = excluded.updated_at",
                (user_id, int(on), now),
            )
            if not on:
                await tx.change("DELETE FROM profiles WHERE user_id = ?", (user_id,))
                await queue_sync(tx, profiles=[user_id])
        if not on:
            self._notify()

    async def get(self, user_id: str) -> Profile | None:
        """The user's profile, or None."""
        rows = await self.store.read(
            "SELECT user_id, fields, text, created_at, updated_at FROM profiles"
            " WHERE user_id = ?",
            (user_id,),
        )
        if not rows:
            return None
        row = rows[0]
        return Profile(row[0], json.loads(row[1]), row[2], row[3], row[4])

    async def usable(self, user_id: str) -> Profile | None:
        """The profile if consent is on (what recall may use), else None."""
        rows = await self.store.read(
            "SELECT 1 FROM consent WHERE user_id = ? AND profile = 1", (user_id,)
        )
        return await self.get(user_id) if rows else None

    def redacted(self, fields: Mapping[str, Any], text: str) -> tuple[dict[str, Any], str]:
        """The fields and text as they are stored: secrets redacted like turns and facts."""
        return redact_fields(fields, self.store.redact), self.store.redact(text.strip())

    async def put(self, user_id: str, fields: Mapping[str, Any], text: str) -> Profile:
        """Write the whole profile, secrets redacted; needs consent (ConsentRequired otherwise)."""
        if not isinstance(fields, Mapping) or not all(isinstance(k, str) for k in fields):
            raise FactError("fields must be an object with string keys", "fields")
        if not isinstance(text, str):
            raise FactError("text must be a string", "text")
        if len(json.dumps(dict(fields), ensure_ascii=False)) + len(text) > MAX_PROFILE_CHARS:
            raise FactError(f"a profile is at most {MAX_PROFILE_CHARS} characters", "fields")
        fields, text = self.redacted(fields, text)
        encoded = json.dumps(fields, ensure_ascii=False)
        now = time.time()
        async with self.store.write() as tx:
            allowed = await tx.execute(
                "SELECT 1 FROM consent WHERE user_id = ? AND profile = 1", (user_id,)
            )
            if not allowed:
                raise ConsentRequired("turn consent on before writing a profile", "consent")
            await tx.change(
                "INSERT INTO profiles (user_id, fields, text, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (user_id) DO UPDATE SET"
                " fields = excluded.fields, text = excluded.text, updated_at = excluded.updated_at",
                (user_id, encoded, text, now, now),
            )
            await queue_sync(tx, profiles=[user_id])
        self._notify()
        profile = await self.get(user_id)
        assert profile is not None
        return profile

    async def delete(self, user_id: str) -> bool:
        """Delete the profile (consent stays as it is)."""
        async with self.store.write() as tx:
            deleted = await tx.change("DELETE FROM profiles WHERE user_id = ?", (user_id,))
            await queue_sync(tx, profiles=[user_id])
        self._notify()
        return deleted > 0


def _value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value)
