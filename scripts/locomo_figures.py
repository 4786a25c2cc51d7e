"""LoCoMo figures shared by the evaluation through the proxy and the in-process tuning harness.

Each configuration yields one row per question (``sample_id``, ``category`` and the figures:
``@k`` over the full ranking, ``Bn`` evidence in the block at budget n). From those rows:

* per conversation and per category means;
* leave-one-conversation-out: for each conversation, the configuration that scores best on
  the other conversations (at the target budget) is chosen, and its figures on the held-out
  conversation are reported. With one configuration this is just the per-conversation table;
  with a grid it says what tuning on four conversations buys on the fifth.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

GROUPS = {"cat 1-4": (1, 2, 3, 4), "all": (1, 2, 3, 4, 5)}
Rows = Sequence[Mapping[str, Any]]


def mean_of(rows: Rows, key: str) -> float:
    return statistics.fmean(r["figures"][key] for r in rows) if rows else float("nan")


def in_group(rows: Rows, group: str) -> list[Mapping[str, Any]]:
    categories = GROUPS.get(group) or (int(group.split()[-1]),)
    return [r for r in rows if r["category"] in categories]


def per_conversation(rows: Rows, keys: Sequence[str], group: str) -> dict[str, dict[str, float]]:
    """conversation -> {n, key: mean} over the group's questions, then "mean" over all."""
    out: dict[str, dict[str, float]] = {}
    chosen = in_group(rows, group)
    for sample in dict.fromkeys(r["sample_id"] for r in chosen):
        mine = [r for r in chosen if r["sample_id"] == sample]
        out[sample] = {"n": len(mine)} | {k: mean_of(mine, k) for k in keys}
    out["mean"] = {"n": len(chosen)} | {k: mean_of(chosen, k) for k in keys}
    return out


def leave_one_out(
    configs: Mapping[str, Rows], keys: Sequence[str], group: str, select_on: str
) -> dict[str, tuple[str, dict[str, float]]]:
    """held-out conversation -> (configuration chosen on the others, its held-out figures).

    "mean" pools the held-out questions of every conversation (each judged under the
    configuration chosen without it).
    """
    samples = list(dict.fromkeys(r["sample_id"] for rows in configs.values() for r in rows))
    out: dict[str, tuple[str, dict[str, float]]] = {}
    pooled: list[Mapping[str, Any]] = []
    for held in samples:
        def trained(name: str, held: str = held) -> float:
            rows = [r for r in in_group(configs[name], group) if r["sample_id"] != held]
            return mean_of(rows, select_on) if rows else 0.0

        best = max(configs, key=trained)  # ties: the first configuration given
        mine = [r for r in in_group(configs[best], group) if r["sample_id"] == held]
        out[held] = (best, {"n": len(mine)} | {k: mean_of(mine, k) for k in keys})
        pooled += mine
    out["mean"] = ("", {"n": len(pooled)} | {k: mean_of(pooled, k) for k in keys})
    return out


def print_tables(
    configs: Mapping[str, Rows], keys: Sequence[str], select_on: str,
    groups: Sequence[str] = ("all", "cat 1-4"),
) -> None:
    """Per configuration: per conversation and per category; then leave-one-out per group."""
    head = " ".join(f"{k:>6}" for k in keys)
    for name, rows in configs.items():
        for group in groups:
            print(f"\n[{name}] {group}, per conversation")
            print(f"{'conversation':14} {'n':>5} {head}")
            for sample, row in per_conversation(rows, keys, group).items():
                print(f"{sample:14} {row['n']:>5.0f} " + " ".join(f"{row[k]:6.3f}" for k in keys))
        print(f"\n[{name}] per category (5 = adversarial)")
        print(f"{'category':14} {'n':>5} {head}")
        for c in range(1, 6):
            chosen = in_group(rows, f"cat {c}")
            if chosen:
                print(f"{f'cat {c}':14} {len(chosen):>5} "
                      + " ".join(f"{mean_of(chosen, k):6.3f}" for k in keys))
    for group in groups:
        print(f"\nleave-one-conversation-out, {group} (configuration chosen on the other "
              f"conversations by {select_on}; {len(configs)} configuration(s))")
        print(f"{'held out':14} {'n':>5} {head}  chosen")
        for sample, (best, row) in leave_one_out(configs, keys, group, select_on).items():
            print(f"{sample:14} {row['n']:>5.0f} " + " ".join(f"{row[k]:6.3f}" for k in keys)
                  + f"  {best}")


def print_report(results: Mapping[str, Any], budgets: Sequence[int], ks: Sequence[int],
                 dragon: Mapping[int, float], target: tuple[int, float]) -> list[str]:
    """The main table per arm and group, per category, block sizes; the target lines
    (returned too)."""
    keys = [f"@{k}" for k in ks] + [f"B{b}" for b in budgets]
    head = f"{'arm':24} {'group':8} {'n':>5} " + " ".join(f"{k:>6}" for k in keys)
    print("\nrecall@k: evidence turns in the first k items; Bn: evidence turns in the block at "
          "budget n tokens")
    print(head)
    for arm, result in results.items():
        for group in ("cat 1-4", "all"):
            if row := result["summary"].get(group):
                print(f"{arm:24} {group:8} {row['n']:>5} " + " ".join(f"{row[k]:6.3f}" for k in keys))
    print("\nper category (category 5 = adversarial)")
    print(head)
    for arm, result in results.items():
        for c in range(1, 6):
            if row := result["summary"].get(f"cat {c}"):
                print(f"{arm:24} {f'cat {c}':8} {row['n']:>5} " + " ".join(f"{row[k]:6.3f}" for k in keys))
    print("\nblock size per budget: mean items / mean tokens; answers over their budget")
    for arm, result in results.items():
        print(f"  {arm:24} " + "   ".join(
            f"B{b}: {result['items'][str(b)]:.1f} / {result['tokens'][str(b)]:.0f}" for b in budgets
        ) + f"   over budget: {result['over_budget']}")
    lines = []
    budget, goal = target
    for arm, result in results.items():
        if arm.startswith(("bm25", "dense")):
            continue
        for group in ("cat 1-4", "all"):
            row = result["summary"].get(group)
            if not row:
                continue
            beats = all(row[f"@{k}"] > dragon[k] for k in ks)
            lines.append(f"{arm} {group}: beat DRAGON at every k: {'yes' if beats else 'NO'} ("
                         + ", ".join(f"@{k} {row[f'@{k}']:.3f} vs {dragon[k]}" for k in ks) + ")")
            if f"B{budget}" in row:
                value = row[f"B{budget}"]
                lines.append(f"{arm} {group}: evidence recall at {budget} tokens {value:.3f} "
                             f"(target >= {goal}: {'yes' if value >= goal else 'NO'})")
        lines.append(f"{arm}: answers over budget: {result['over_budget']} (must be 0)")
    print("\n" + "\n".join(lines))
    return lines
