"""Candidates from the top of each search, scored from deeper in both.

Dense and lexical search each name their best `k`; an item only one of them named would
get 0 from the other, though the other usually ranked it just past its `k`. Reading both
lists deeper (cheap: the vector search is exact over a user's vectors, and FTS5 scores
every matching row before its LIMIT anyway) gives those items their real score.
"""

from __future__ import annotations

from collections.abc import Sequence


def top_with_depth(
    dense: Sequence[tuple[str, float]], lexical: Sequence[tuple[int, float]], k: int
) -> tuple[list[tuple[str, float]], list[tuple[int, float]]]:
    """The first `k` of each list (dense keys are "c<chunk id>"), with every score either
    list holds for them."""
    keep = {int(key[1:]) for key, _ in dense[:k]} | {chunk for chunk, _ in lexical[:k]}
    return (
        [(key, score) for key, score in dense if int(key[1:]) in keep],
        [(chunk, score) for chunk, score in lexical if chunk in keep],
    )
