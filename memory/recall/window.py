"""The turns around a strong match: how far recall looks from it, and what they gain.

An answer often shares no words with its question, and the turn that holds it is not always
the very next one ("Why did Jon start his dance studio?" is answered two turns before the
turn about the studio: "Lost my job as a banker yesterday ..."). So the turns within a few
steps of each of the best items gain a share of its score, less at each step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memory.log.turn_log import TurnLog
from memory.recall.ranking import Candidate


@dataclass(frozen=True)
class Window:
    """How the turns around the best items are lifted."""

    share: float = 0.4  # of a seed's score, given to the turns next to it
    hops: int = 1  # how many steps away a turn can be
    decay: float = 0.5  # the share's factor at each further step
    seeds: int = 30  # how many of the best items lend to their neighbours


async def neighbourhood(log: TurnLog, seeds: Sequence[int], hops: int) -> list[tuple[int, int, int]]:
    """(seed, chunk, steps) for every chunk within `hops` neighbour steps of a seed chunk
    (the fewest steps each; the seed itself left out). One query per step."""
    reach: dict[int, dict[int, int]] = {seed: {seed: 0} for seed in seeds}
    frontier: dict[int, set[int]] = {seed: {seed} for seed in seeds}
    for step in range(1, hops + 1):
        ids = sorted(set().union(*frontier.values()))
        if not ids:
            break
        after: dict[int, list[int]] = {}
        for chunk, neighbour in await log.neighbour_chunks(ids):
            after.setdefault(chunk, []).append(neighbour)
        for seed, front in frontier.items():
            found = {n for chunk in front for n in after.get(chunk, ()) if n not in reach[seed]}
            reach[seed].update(dict.fromkeys(found, step))
            frontier[seed] = found
    return [(seed, chunk, steps) for seed, near in reach.items() for chunk, steps in near.items() if steps]


def add_window(
    ranked: Sequence[Candidate],
    neighbours: Mapping[str, Sequence[tuple[str, int]]],
    added: Mapping[str, Candidate],
    window: Window,
) -> list[Candidate]:
    """Give the turns around each of the best items a share of its score, and re-rank.

    `neighbours` maps a seed's key to (key, steps) of the turns around it; `added` holds the
    turns that were not candidates (scored 0). A turn `steps` away is offered
    share * decay ** (steps - 1) of the seed's score and takes the largest offer, from the
    first `window.seeds` items.
    """
    bonus: dict[str, float] = {}
    for seed in ranked[: window.seeds]:
        for key, steps in neighbours.get(seed.key, ()):
            if key != seed.key:
                offer = window.share * window.decay ** (steps - 1) * seed.score
                bonus[key] = max(bonus.get(key, 0.0), offer)
    everyone = {c.key: c for c in ranked} | {k: c for k, c in added.items() if k in bonus}
    for key, extra in bonus.items():
        c = everyone.get(key)
        if c is not None:
            c.signals["context"] = round(extra, 4)
            c.score = round(c.score + extra, 6)
    return sorted(everyone.values(), key=lambda c: (-c.score, -c.created_at, c.key))
