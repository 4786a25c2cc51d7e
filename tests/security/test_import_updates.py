"""An import may now change facts already stored (a newer export's versions and pin, issue 39):
it changes only the memory the caller may write, never another user's matching fact."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.conftest import RunningProxy
from tests.support.memory import QUIET, memory_api

KEYS = "key-victim-0001:victim,key-mallory-01:mallory"


def test_a_newer_chain_of_another_user_s_fact_changes_only_the_importer_s_memory(
    start_proxy: Callable[..., RunningProxy],
) -> None:
    proxy = start_proxy(memory=True, api_keys=KEYS, **QUIET)
    victim = {"Authorization": "Bearer key-victim-0001"}
    mallory = {"Authorization": "Bearer key-mallory-01"}
    with memory_api(proxy, **victim) as api:
        fact = api.post("/facts", json={"text": "Victim's door code is private",
                                         "category": "context", "pinned": True}).json()
    # Mallory knows the fact's first version exactly and writes a "newer" chain for it.
    first = {"type": "fact", "id": fact["id"], "text": fact["text"], "category": "context",
             "confidence": 0.6, "importance": 5, "first_seen": fact["first_seen"],
             "created_at": fact["created_at"], "updated_at": fact["updated_at"],
             "pinned": True, "valid_to": fact["created_at"] + 1, "superseded_by": 999_001}
    newer = {**first, "id": 999_001, "text": "Victim's door code is 1234", "version": 2,
             "previous_id": fact["id"], "pinned": False, "valid_to": None,
             "superseded_by": None, "updated_at": fact["updated_at"] + 100}
    lines = "\n".join(json.dumps(r) for r in (first, newer)) + "\n"
    ndjson = {"Content-Type": "application/x-ndjson"}
    with memory_api(proxy, **mallory) as api:
        named = api.post("/import", content=lines,
                         headers={**ndjson, "X-Memory-User-Id": "victim"})
        assert named.status_code == 403, named.text  # a key bound to mallory names only her
        own = api.post("/import", content=lines, headers=ndjson)
        assert own.status_code == 200, own.text
        assert own.json()["added"]["facts"] == 2 and own.json()["updated"]["facts"] == 0
    with memory_api(proxy, **victim) as api:
        held = api.get("/facts", params={"include_inactive": "true"}).json()["data"]
    assert [(f["id"], f["text"], f["pinned"], f["active"]) for f in held] == [
        (fact["id"], "Victim's door code is private", True, True)]
