"""The memory CLI's commands, one function each, that proxy/cli/memory.py gives their
subcommands."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from urllib.parse import quote

from proxy.cli.client import CliError, MemoryClient, UsageError, emit, given, upload
from proxy.cli.render import Progress, count, table, when

PAGE = 200


def memories_list(client: MemoryClient, args: argparse.Namespace) -> None:
    """Facts, newest first, following pages up to --limit."""
    params = {"limit": min(PAGE, max(1, args.limit)),
              **given(category=args.category, q=args.query or None,
                      pinned="true" if args.pinned else None,
                      include_inactive="true" if args.all else None)}
    facts = client.pages("/facts", params, args.limit)
    rows = [[f["id"], f["category"], f"{f['confidence']:.2f}", "*" if f["pinned"] else "",
             f["text"] if f["active"] else f"(v{f['version']}, inactive) {f['text']}"]
            for f in facts]
    emit(args, facts, table(["ID", "CATEGORY", "CONF", "PIN", "TEXT"], rows) if facts
         else "No facts.")


def memories_search(client: MemoryClient, args: argparse.Namespace) -> None:
    """What would be injected for a query, in block order, with each item's source and
    score (the block is not ordered by score: the first column says where each item is)."""
    body = {"query": args.query,
            **given(budget=args.budget, scope=args.scope, session_id=args.session)}
    result = client.call("POST", "/search", json=body)
    rows = [[i + 1, item["source"], f"{item['score']:.3f}", item.get("session_id", ""),
             item["text"]] for i, item in enumerate(result["items"])]
    summary = (f"{count(len(result['items']), 'item')} in block order, {result['tokens']} of"
               f" {count(result['budget'], 'token')}"
               f"{' (truncated)' if result.get('truncated') else ''}")
    text = table(["IN BLOCK", "SOURCE", "SCORE", "SESSION", "TEXT"], rows) + "\n" + summary if rows \
        else f"Nothing would be injected ({result.get('skipped') or 'no match'})."
    emit(args, result, text)


def memories_add(client: MemoryClient, args: argparse.Namespace) -> None:
    """Remember a fact."""
    body = {"text": args.text, "category": args.category, "pinned": args.pin,
            **given(confidence=args.confidence, importance=args.importance)}
    fact = client.call("POST", "/facts", json=body)
    emit(args, fact, f"Added fact {fact['id']} ({fact['category']}): {fact['text']}")


def memories_edit(client: MemoryClient, args: argparse.Namespace) -> None:
    """Change a fact: a new version, the old one kept as history."""
    body = given(text=args.text, category=args.category, confidence=args.confidence,
                 importance=args.importance)
    if not body:
        raise CliError("nothing to change: give --text, --category, --confidence or --importance")
    fact = client.call("PATCH", f"/facts/{args.id}", json=body)
    emit(args, fact, f"Fact {args.id} is now fact {fact['id']} (version {fact['version']}): "
                     f"{fact['text']}")


def memories_forget(client: MemoryClient, args: argparse.Namespace) -> None:
    """Delete a fact and its history; prints the undo token."""
    result = client.call("DELETE", f"/facts/{args.id}")
    seconds = max(0.0, result["expires_at"] - time.time())
    emit(args, result, f"Forgot fact {args.id} and its history.\n"
                       + _undo_hint(args, result["undo_token"], seconds))


def memories_pin(client: MemoryClient, args: argparse.Namespace) -> None:
    """Pin or unpin a fact."""
    fact = client.call("POST", f"/facts/{args.id}/{'unpin' if args.off else 'pin'}")
    emit(args, fact, f"{'Unpinned' if args.off else 'Pinned'} fact {fact['id']}: {fact['text']}")


def memories_export(client: MemoryClient, args: argparse.Namespace) -> None:
    """Stream the export to a file (or stdout), counting records."""
    out = args.output.open("wb") if args.output else sys.stdout.buffer
    progress = Progress("exporting", None)
    counts: dict[str, int] = {}
    try:
        for line in client.stream("/export"):
            record = json.loads(line)
            if record.get("type") == "meta":
                progress.total = sum(record["counts"].values()) + 1
            counts[record["type"]] = counts.get(record["type"], 0) + 1
            out.write(line + b"\n")
            progress.advance()
    finally:
        progress.finish()
        if args.output:
            out.close()
    counts.pop("meta", None)
    where = str(args.output) if args.output else "stdout"
    if args.json and args.output:  # stdout is free for the summary
        print(json.dumps({"file": where, "records": counts}))
    else:
        print(f"Exported {_counted(counts)} to {where}.", file=sys.stderr)


def memories_import(client: MemoryClient, args: argparse.Namespace) -> None:
    """Upload a JSON Lines file; the server indexes new turns in the background."""
    chunks, progress = upload(args.file)
    try:
        result = client.call("POST", "/import", content=chunks,
                             headers={"Content-Type": "application/x-ndjson"})
    finally:
        progress.finish()
    ignored = [f"{n} {'message' if n == 1 else 'messages'} "
               + ("with no text" if reason == "no_text" else f"with role {reason}")
               for reason, n in result.get("ignored", {}).items() if n]
    left_out = f"; left out: {', '.join(ignored)}" if ignored else ""
    updated = result.get("updated", {})
    newer = f"; updated to the file's newer version: {_counted(updated)}" if any(
        updated.values()) else ""
    emit(args, result, f"Imported {_counted(result['added'])}{newer}; already there: "
                       f"{_counted(result['skipped'])}{left_out}.")


def memories_clear(client: MemoryClient, args: argparse.Namespace) -> None:
    """Delete all memory of the user; prints the undo token."""
    if not args.yes:
        raise UsageError("clear deletes all memory of the user (or organisation): add --yes")
    receipt = client.call("POST", "/clear")
    seconds = receipt["expires_at"] - receipt["created_at"]
    removed = receipt["removed"]
    shown = {kind: removed.get(kind, 0) for kind in ("turns", "facts", "summaries", "profile")}
    emit(args, receipt, f"Cleared {_counted(shown)}. "
                        + _undo_hint(args, receipt["undo_token"], seconds))


def _undo_hint(args: argparse.Namespace, token: str, seconds: float) -> str:
    """The command that undoes, for the same memproxy and the same user or organisation: a
    token works only for the memory it came from (404 for anyone else's)."""
    words = ["memproxy", "memories", "undo"]
    for option in ("url", "user", "org"):
        if getattr(args, option):
            words += [f"--{option}", getattr(args, option)]
    words.append(f"--token={token}")
    # The key itself is not printed back (a terminal's scrollback outlives it).
    key = " with the same --key" if args.key else ""
    return f"Undo within {seconds:.0f} s{key}: {shlex.join(words)}"


def memories_undo(client: MemoryClient, args: argparse.Namespace) -> None:
    """Bring back what a clear or a forget removed, within its window."""
    report = client.call("POST", "/clear/undo", json={"undo_token": args.undo_token})
    emit(args, report, f"Restored {_counted(report['added'])}.")


def sessions_list(client: MemoryClient, args: argparse.Namespace) -> None:
    """Sessions, most recently active first."""
    sessions = client.pages("/sessions", {"limit": min(PAGE, max(1, args.limit))}, args.limit)
    rows = [[s["session_id"], when(s["last_active"]), s["turns"], s["facts"], s["title"]]
            for s in sessions]
    emit(args, sessions, table(["SESSION", "LAST ACTIVE", "TURNS", "FACTS", "FIRST MESSAGE"], rows)
         if rows else "No sessions.")


def sessions_show(client: MemoryClient, args: argparse.Namespace) -> None:
    """A session's counts and every turn."""
    session = client.call("GET", f"/sessions/{quote(args.session_id, safe='')}")
    turns = client.pages("/turns", {"session_id": args.session_id, "limit": 500})
    lines = [f"Session {session['session_id']}: {count(session['turns'], 'turn')}, "
             f"{count(session['facts'], 'fact')}, last active {when(session['last_active'])}",
             ""]
    lines += [f"[{when(t['created_at'])}] {t['name'] or t['role']}: {t['content']}" for t in turns]
    emit(args, {**session, "turns_list": turns}, "\n".join(lines))


def sessions_delete(client: MemoryClient, args: argparse.Namespace) -> None:
    """Delete a session and what was learned only from it."""
    result = client.call("DELETE", f"/sessions/{quote(args.session_id, safe='')}")
    removed = result["removed"]
    emit(args, result, f"Deleted session {args.session_id}: {count(removed['turns'], 'turn')}, "
                       f"{count(removed['summaries'], 'summary', 'summaries')}, "
                       f"{count(removed['fact_versions'], 'fact version')}.")


def stats_show(client: MemoryClient, args: argparse.Namespace) -> None:
    """Counts, index sizes and the job queue."""
    stats = client.call("GET", "/stats")
    counts, index, jobs = stats["counts"], stats["index"], stats["jobs"]
    rows = [*map(list, counts.items()), ["vectors", index["vectors"]]]
    if "database_bytes" in index:  # the whole store's figures: shown to the admin key only
        rows += [["database size", _size(index["database_bytes"])],
                 ["vector index size", _size(index["vectors_bytes"])]]
    if jobs is not None:
        rows += [["jobs queued or running", jobs["depth"]], ["dead letters", jobs["dead"]]]
    emit(args, stats, f"Memory of {stats['user_id']}\n" + table(["WHAT", "COUNT"], rows))


_NOUNS = {"turn": ("turn", "turns"), "fact": ("fact", "facts"),
          "summary": ("summary", "summaries"), "profile": ("profile", "profiles")}


def _counted(counts: dict[str, int]) -> str:
    """`{"turns": 2, "fact": 1}` as "2 turns, 1 fact"."""
    nouns = [(n, _NOUNS.get(name.removesuffix("s").replace("summarie", "summary"), (name, name)))
             for name, n in counts.items() if n]
    return ", ".join(count(n, *noun) for n, noun in nouns) or "nothing"


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"

