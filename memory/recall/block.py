"""Packing learned memory and past turns into one fenced block within an exact token budget.

Layout inside the fence (`memory.recall.render.wrap`): facts grouped by category under "What you
know about this user", then the user's profile, then the most relevant summary, then the
past turns, then what the user's organisation shares. Filling goes by priority with shares
of the budget, so that no section can starve the others: facts up to FACTS_SHARE, the
profile up to PROFILE_SHARE, one summary up to SUMMARY_SHARE (cut at a sentence when
longer), the organisation's facts up to `shared_share`, then turns take what is left, and
facts (the user's, then the organisation's) that did not fit their share take any
remainder. The whole block is counted again at the end; while it is over the budget, the
lowest-priority line is dropped (turns, the organisation's facts, the summary, the profile,
then facts), so the count is always exact. With nothing learned the block is exactly
`memory.recall.render.pack`'s (the
turns under the same heading).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from memory.recall.learned_recall import Learned, LearnedItem
from memory.recall.render import (
    MAX_SKIPPED,
    PREAMBLE,
    Entry,
    ExcerptCost,
    excerpts,
    neutralise,
    pack,
    render_line,
    wrap,
)
from memory.recall.render import TURNS_HEADING as TURNS_HEADING  # its home since both use it

FACTS_SHARE = 0.4
PROFILE_SHARE = 0.15
SUMMARY_SHARE = 0.3
FACTS_HEADING = "What you know about this user:"
PROFILE_HEADING = "The user's own profile:"
SUMMARY_HEADING = "Summary of an earlier conversation ({day}):"
SHARED_HEADING = "Shared by the user's organisation:"
CATEGORY_ORDER = ("identity", "relationship", "preference", "project", "decision", "todo",
                  "context")

Count = Callable[[str], int]


@dataclass
class BlockPack:
    """The block and what made it in (indexes into the inputs)."""

    block: str = ""
    tokens: int = 0
    facts: list[int] = field(default_factory=list)
    profile_lines: int = 0
    summary: str | None = None  # the summary text as rendered (maybe cut)
    summary_index: int | None = None
    turns: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)
    truncated: bool = False

    def chosen(self, learned: Learned) -> list[LearnedItem]:
        """The learned items in the block: facts, the profile, the summary, shared facts."""
        items = [learned.facts[i] for i in self.facts]
        if self.profile_lines and learned.profile is not None:
            items.append(learned.profile)
        if self.summary_index is not None:
            items.append(learned.summaries[self.summary_index])
        return items + [learned.shared[i] for i in self.shared]


def pack_block(
    learned: Learned, entries: Sequence[Entry], budget: int, count: Count, *,
    shared_share: float = 0.0, preamble: str = PREAMBLE,
) -> BlockPack:
    """Fill and render the block (see the module docstring) under `preamble`."""
    if not learned:
        packed = pack(entries, budget, count, preamble=preamble)
        return BlockPack(packed.block, packed.tokens, turns=packed.included,
                         truncated=packed.truncated)
    result = BlockPack(truncated=True)
    if budget <= 0 or count(wrap([], preamble)) > budget:
        return result
    room = budget - count(wrap([], preamble))
    used = 0

    def take(cost: int, cap: float) -> bool:
        nonlocal used
        if used + cost > room or cost > cap:
            return False
        used += cost
        return True

    def fill(lines: list[str], chosen: list[int], heading: str, cap: float, *,
             first_anyway: bool = False, in_order: bool = False) -> None:
        """Take the lines not `chosen` yet, in order, within `cap` tokens (the first one
        past it when `first_anyway`; none after the first that does not fit when
        `in_order`); the heading is paid with the section's first line."""
        spent, head = 0.0, count(heading) + 1 if heading else 0
        for i, line in enumerate(lines):
            if i in chosen:
                continue
            cost = count(line) + 1 + (0 if chosen else head)
            if take(cost, max(cap - spent, cost if first_anyway and not chosen else 0)):
                chosen.append(i)
                spent += cost
            elif in_order:
                break

    fact_lines = [fact_line(f) for f in learned.facts]
    fill(fact_lines, result.facts, FACTS_HEADING, FACTS_SHARE * budget, first_anyway=True)
    if learned.profile is not None:  # its first lines, as many as fit
        taken: list[int] = []
        fill(profile_lines(learned.profile), taken, PROFILE_HEADING, PROFILE_SHARE * budget,
             in_order=True)
        result.profile_lines = len(taken)
    for index, summary in enumerate(learned.summaries[:1]):
        head = count(summary_heading(summary)) + 1
        text = fit_text(summary.text, int(SUMMARY_SHARE * budget) - head, count)
        if text and take(head + count(text) + 1, SUMMARY_SHARE * budget):
            result.summary, result.summary_index = text, index
    shared_lines = [fact_line(f) for f in learned.shared]
    fill(shared_lines, result.shared, SHARED_HEADING, shared_share * budget)
    costs = ExcerptCost(count)  # turns are shown as dated excerpts, as without learned items
    skipped = 0
    for i, entry in enumerate(entries):
        cost = costs.of(entry, render_line(entry)) + (
            0 if result.turns else count(TURNS_HEADING) + 1
        )
        if take(cost, room):
            result.turns.append(i)
            costs.take(entry)
        elif (skipped := skipped + 1) >= MAX_SKIPPED:
            break
    # The rest of the room goes to facts (no heading counted: the final count is exact).
    fill(fact_lines, result.facts, "", room)
    fill(shared_lines, result.shared, SHARED_HEADING, room)
    return _finish(result, learned, (fact_lines, shared_lines), entries, budget, count,
                   preamble)


def _finish(
    result: BlockPack, learned: Learned, lines_of_facts: tuple[list[str], list[str]],
    entries: Sequence[Entry], budget: int, count: Count, preamble: str,
) -> BlockPack:
    """Render, then drop the lowest-priority line while the block is over the budget.
    `lines_of_facts`: the rendered lines of the user's facts, and of the shared ones."""
    while True:
        lines = _render(result, learned, lines_of_facts, entries)
        if not lines:
            return BlockPack(truncated=True)
        block = wrap(lines, preamble)
        tokens = count(block)
        if tokens <= budget:
            shown = (len(result.facts) + len(result.turns) + (result.summary is not None)
                     + len(result.shared))
            offered = (len(learned.facts) + len(entries) + min(1, len(learned.summaries))
                       + len(learned.shared))
            result.block, result.tokens = block, tokens
            result.truncated = shown < offered or (
                learned.profile is not None
                and result.profile_lines < len(profile_lines(learned.profile))
            )
            return result
        if result.turns:
            result.turns.pop()
        elif result.shared:
            result.shared.pop()
        elif result.summary is not None:
            result.summary = result.summary_index = None
        elif result.profile_lines:
            result.profile_lines -= 1
        else:
            result.facts.pop()


def _render(
    result: BlockPack, learned: Learned, lines_of_facts: tuple[list[str], list[str]],
    entries: Sequence[Entry],
) -> list[str]:
    lines = _by_category(FACTS_HEADING, result.facts, learned.facts, lines_of_facts[0])
    if learned.profile is not None and result.profile_lines:
        lines += [PROFILE_HEADING, *profile_lines(learned.profile)[: result.profile_lines]]
    if result.summary is not None and result.summary_index is not None:
        summary = learned.summaries[result.summary_index]
        lines += [summary_heading(summary), "  " + result.summary.replace("\n", "\n  ")]
    if result.turns:
        lines += [TURNS_HEADING, *excerpts([entries[i] for i in result.turns])]
    return lines + _by_category(SHARED_HEADING, result.shared, learned.shared, lines_of_facts[1])


def _by_category(
    heading: str, chosen: list[int], facts: list[LearnedItem], lines: list[str]
) -> list[str]:
    """`heading` and the `lines` of the `chosen` facts, by category; nothing if none is."""
    order = sorted(chosen, key=lambda i: (_category_rank(facts[i]), i))
    return [heading, *(lines[i] for i in order)] if chosen else []


def fact_line(fact: LearnedItem) -> str:
    """`- (preference) User prefers TypeScript.`"""
    return f"- ({fact.category}) {neutralise(fact.text.strip())}".replace("\n", " ")


def profile_lines(profile: LearnedItem) -> list[str]:
    """The profile's lines, indented."""
    return ["  " + neutralise(line) for line in profile.text.splitlines() if line.strip()]


def summary_heading(summary: LearnedItem) -> str:
    """The heading of a summary, dated."""
    day = datetime.fromtimestamp(summary.created_at, UTC).strftime("%Y-%m-%d")
    return SUMMARY_HEADING.format(day=day)


def fit_text(text: str, cap: int, count: Count) -> str:
    """`text` (neutralised) cut to at most `cap` tokens at a sentence end, else at a word."""
    text = neutralise(text.strip())
    if cap <= 0:
        return ""
    if count(text) <= cap:
        return text
    sentences = text.replace("\n", " ").split(". ")
    while len(sentences) > 1:
        sentences.pop()
        cut = ". ".join(sentences).rstrip(".") + "."
        if count(cut) <= cap:
            return cut
    words = text.split()
    while words and count(" ".join(words) + " …") > cap:
        words = words[: max(0, len(words) - max(1, len(words) // 8))]
    return " ".join(words) + " …" if words else ""


def _category_rank(fact: LearnedItem) -> int:
    return CATEGORY_ORDER.index(fact.category) if fact.category in CATEGORY_ORDER else 99
