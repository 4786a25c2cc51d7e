"""Consent and the user-authored profile (memory/learning/profiles.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from memory import redact_profile
from proxy.management.access import Caller, respond
from proxy.management.bodies import ConsentChange, ProfileBody
from proxy.management.inputs import json_body
from proxy.management.operations import memory


async def profile_state(who: Caller) -> dict[str, Any]:
    """Consent and the profile, redacted again (this API, MCP's read_profile)."""
    profiles = who.memory.profiles
    profile = await profiles.get(who.user_id)
    body = None if profile is None else redact_profile(
        {k: v for k, v in profile.as_dict().items() if k != "user_id"}, who.memory.redact)
    return {"consent": await profiles.consent(who.user_id), "profile": body}


async def _state(who: Caller) -> dict[str, Any]:
    return {"object": "memory.profile", "user_id": who.user_id, **await profile_state(who)}


async def _show(request: Request, who: Caller) -> Response:
    """GET /v1/memory/profile (and /consent): consent and the profile."""
    return respond(await _state(who))


get_consent = memory("GET /consent", "Consent and profile", "Profile")(_show)
get_profile = memory("GET /profile", "Consent and profile", "Profile")(_show)


@memory("PUT /consent", "Give or revoke consent (revoking deletes the profile)", "Profile",
        "400", "413", body=ConsentChange)
async def put_consent(request: Request, who: Caller) -> Response:
    """PUT /v1/memory/consent: revoking deletes the profile and its vector."""
    body = await json_body(request, who.settings.max_body_bytes, ConsentChange)
    await who.memory.profiles.set_consent(who.user_id, body.consent)
    return respond(await _state(who))


@memory("PUT /profile", "Write the profile (needs consent)", "Profile", "400", "409", "413",
        body=ProfileBody)
async def put_profile(request: Request, who: Caller) -> Response:
    """PUT /v1/memory/profile: the whole profile; 409 without consent."""
    body = await json_body(request, who.settings.max_body_bytes, ProfileBody)
    await who.memory.profiles.put(who.user_id, body.fields, body.text)
    return respond(await _state(who))


@memory("DELETE /profile", "Delete the profile (consent stays)", "Profile")
async def delete_profile(request: Request, who: Caller) -> Response:
    """DELETE /v1/memory/profile: the profile goes, consent stays as it is."""
    await who.memory.profiles.delete(who.user_id)
    return respond(await _state(who))
