"""The LoCoMo evaluation's bookkeeping: leave-one-conversation-out, and crediting what a
client actually receives."""

from __future__ import annotations

from typing import Any

from scripts.eval_locomo import Conversation, Turn, credited
from scripts.locomo_figures import leave_one_out, per_conversation


def row(sample: str, category: int, value: float) -> dict[str, Any]:
    return {"sample_id": sample, "category": category, "figures": {"B1000": value}}


def test_leave_one_out_chooses_on_the_other_conversations_only() -> None:
    configs = {
        # a: best on x and y, poor on z; b: the other way round.
        "a": [row("x", 1, 1.0), row("y", 1, 1.0), row("z", 1, 0.0)],
        "b": [row("x", 1, 0.5), row("y", 1, 0.5), row("z", 1, 0.9)],
    }
    out = leave_one_out(configs, ["B1000"], "cat 1-4", "B1000")
    # Held out x: on y and z, a scores 0.5 and b 0.7, so b is chosen and x is judged under b.
    assert out["x"] == ("b", {"n": 1, "B1000": 0.5})
    assert out["y"] == ("b", {"n": 1, "B1000": 0.5})
    # Held out z: a wins on x and y (1.0 vs 0.5), and scores 0 on z.
    assert out["z"] == ("a", {"n": 1, "B1000": 0.0})
    assert out["mean"][1]["B1000"] == (0.5 + 0.5 + 0.0) / 3
    # Category 5 is left out of "cat 1-4", counted in "all".
    configs["a"].append(row("x", 5, 0.0))
    assert per_conversation(configs["a"], ["B1000"], "cat 1-4")["x"]["B1000"] == 1.0
    assert per_conversation(configs["a"], ["B1000"], "all")["x"]["B1000"] == 0.5


def test_an_item_counts_only_when_its_text_is_in_the_block() -> None:
    conv = Conversation("c", "Ana", "Bo", [(1, [
        Turn("D1:1", "Ana", "I adopted a greyhound."), Turn("D1:2", "Bo", "Lovely! So fast."),
    ])], [])
    items = [{"text": "I adopted a greyhound."}, {"text": "Lovely! So fast."},
             {"text": "Lovely!"}]
    block = "<memory>\n[2024-01-01]\nBo: Lovely!\n  So fast.\n</memory>"
    # Whitespace aside, the second item is shown; the first is not in the block at all; the
    # third is a part of D1:2 and stands for it.
    assert credited(conv, items, block) == [set(), {"D1:2"}, {"D1:2"}]
