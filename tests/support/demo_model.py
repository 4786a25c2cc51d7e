"""The scripted upstream's `--demo` mode: a stand-in model that lets memory work end to end.

It recognises the learning prompts memproxy sends (memory/learning/prompts.py) and answers
them with valid JSON: facts drawn from the user's NEW messages by a few plain patterns ("my
name is X", "I like X", "I work on X", "I live in X"), and a summary quoting the user.
Chat requests get a short reply that says what the memory block in the prompt holds, so a
newcomer sees what was recalled. Both chat completions and Anthropic Messages, streamed or
not; anything else gets the scripted upstream's default reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from tests.support import formats
from tests.support.scripted_upstream import (
    JSONReply,
    Received,
    Reply,
    SSEReply,
    chat_chunks,
    chat_completion,
)

# The openings of memproxy's learning prompts (memory/learning/prompts.py).
EXTRACT = "You extract durable facts"
SUMMARY = "You summarise a conversation"
REPAIR = "Your answer could not be used"
# A NEW user line of the extraction transcript: "[2] NEW 2026-05-08 user (Ada): text".
NEW_USER_LINE = re.compile(r"^\[(\d+)\] NEW \S+ user(?: \([^)]*\))?: (.*)$")
ANY_USER_LINE = re.compile(r"^\[\d+\](?: NEW)? \S+ user(?: \([^)]*\))?: (.*)$")
_OBJECT = r"([^.!?;,\n]{1,80})"
PATTERNS: list[tuple[re.Pattern[str], Callable[[re.Match[str]], str], str]] = [
    (re.compile(r"\b[Mm]y name is ([A-Z][\w'-]*(?: [A-Z][\w'-]*)?)"),
     lambda m: f"User's name is {m[1]}.", "identity"),
    (re.compile(r"\bI (?:really )?(like|love|prefer|enjoy) " + _OBJECT, re.I),
     lambda m: f"User {m[1].lower()}s {m[2].strip()}.", "preference"),
    (re.compile(r"\bI(?: work on|'m working on| am working on) " + _OBJECT, re.I),
     lambda m: f"User works on {m[1].strip()}.", "project"),
    (re.compile(r"\bI live in " + _OBJECT, re.I),
     lambda m: f"User lives in {m[1].strip()}.", "identity"),
]


def facts_in(text: str) -> list[tuple[str, str]]:
    """(fact, category) for each pattern the text matches."""
    return [(render(match), category) for pattern, render, category in PATTERNS
            for match in pattern.finditer(text)]


class DemoModel:
    """A responder for `ScriptedUpstream.respond_with`: learning answers and chat replies."""

    def __call__(self, request: Received) -> Reply | None:
        body = request.json if isinstance(request.json, dict) else None
        if body is None or request.method != "POST":
            return None
        if request.path.endswith("/chat/completions"):
            messages = _list(body.get("messages"))
            system = "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
        elif request.path.endswith("/messages"):
            messages = _list(body.get("messages"))
            system = _text(body.get("system"))
        else:
            return None
        users = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
        last = users[-1] if users else ""
        if system.startswith(EXTRACT):
            text = self.extraction(users[0] if users else "")
        elif system.startswith(SUMMARY):
            text = self.summary(users[0] if users else "")
        else:
            text = self.chat(system + "\n" + "\n".join(users), last)
        return _reply(request, body, text)

    def extraction(self, transcript: str) -> str:
        """A JSON array of facts from the transcript's NEW user lines."""
        found = []
        for line in transcript.splitlines():
            if match := NEW_USER_LINE.match(line):
                for fact, category in facts_in(match[2]):
                    found.append({"fact": fact, "category": category, "confidence": 0.9,
                                  "importance": 8, "updates_previous": None, "expires": None,
                                  "turns": [int(match[1])]})
        return json.dumps(found)

    def summary(self, transcript: str) -> str:
        """A summary object quoting the user's messages."""
        said = [m[1].strip() for line in transcript.splitlines()
                if (m := ANY_USER_LINE.match(line))]
        facts = [fact for text in said for fact, _ in facts_in(text)]
        text = "The user said: " + " / ".join(said[-3:]) if said else "Nothing was said yet."
        return json.dumps({"facts": facts, "preferences": [], "decisions": [], "todos": [],
                           "entities": [], "text": text[:600]})

    def chat(self, prompt: str, last: str) -> str:
        """What the memory block holds, else an acknowledgement."""
        remembered = [line[2:].split(") ", 1)[-1] for line in _memory_lines(prompt)
                      if line.startswith("- (")]
        if remembered:
            return "From memory: " + " ".join(remembered)
        return f"Noted: {last.strip()[:200]}" if last.strip() else "Hello."


def _memory_lines(text: str) -> list[str]:
    start, end = text.find("<memory>"), text.rfind("</memory>")
    return text[start:end].splitlines() if start != -1 and end > start else []


def _reply(request: Received, body: dict[str, Any], text: str) -> Reply:
    model, stream = str(body.get("model") or "demo"), body.get("stream") is True
    if request.path.endswith("/messages"):
        if stream:
            return SSEReply(formats.message_events(text, model=model), done=False)
        return JSONReply(formats.message_object(text, model=model))
    if stream:
        return SSEReply(chat_chunks(text, model=model))
    return JSONReply(chat_completion(text, model=model))


def _list(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""
