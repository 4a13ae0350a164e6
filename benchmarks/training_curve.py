"""Held-out top-1 accuracy of a draft head against the answer tokens it was trained on,
from the `recipe.json` of one or more training runs (`cluster train-draft
--eval-every-tokens N` records points within epochs): does more data still help?
Runs since the acceptance-length figure was added also print the held-out acceptance
length of greedy chains (older runs left labels outside the draft vocabulary uncounted,
so their accuracies read higher than the engine sees).

    python benchmarks/training_curve.py RECIPE.json [RECIPE.json ...] \
        [--out benchmarks/results/heldout_accuracy_vs_tokens.png]

Prints a table per run and writes the plot (one line per TTT step and run).
"""

from __future__ import annotations

import argparse
import json
import os


def points(recipe: dict) -> list[tuple[int, list[float], float | None]]:
    """(answer tokens trained on, held-out accuracy per TTT step, held-out acceptance
    length or None), in training order."""
    found = []
    tokens_per_epoch = recipe.get("train_answer_tokens")
    for epoch in recipe["history"]:
        for p in epoch.get("curve", []):
            found.append(
                (
                    p["answer_tokens_seen"],
                    p["held_out_accuracy"],
                    p.get("held_out_acceptance_length"),
                )
            )
        seen = epoch.get("answer_tokens_seen")
        if seen is None and tokens_per_epoch:  # runs from before the curve was recorded
            seen = tokens_per_epoch * epoch["epoch"]
        if seen is not None:
            found.append(
                (seen, epoch["held_out_accuracy"], epoch.get("held_out_acceptance_length"))
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--labels", nargs="+", default=None)
    parser.add_argument("--out", default="benchmarks/results/heldout_accuracy_vs_tokens.png")
    args = parser.parse_args()
    labels = args.labels or [os.path.basename(os.path.dirname(r)) for r in args.recipes]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path, label in zip(args.recipes, labels, strict=True):
        with open(path) as f:
            recipe = json.load(f)
        run = points(recipe)
        print(f"\n{label}: {recipe.get('train_answer_tokens', '?')} answer tokens per epoch")
        print(
            "| answer tokens trained | held-out accuracy per TTT step | acceptance length |\n"
            "|---:|---|---:|"
        )
        for seen, acc, length in run:
            chain = "n/a" if length is None else f"{length:.3f}"
            print(f"| {seen} | {' / '.join(f'{a:.3f}' for a in acc)} | {chain} |")
        for step in range(len(run[0][1]) if run else 0):
            ax.plot(
                [s for s, _, _ in run],
                [a[step] for _, a, _ in run],
                marker=".",
                label=f"{label}, step {step}",
            )
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens trained on (log scale)")
    ax.set_ylabel("held-out top-1 accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
