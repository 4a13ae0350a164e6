"""Chain against tree drafting at equal verified-token budgets, with the shipped EAGLE-3
head on SmolLM2: mean acceptance length and speedup over speculation off at batch 1, 4
and 16; writes a markdown table.

A budget of B drafts per step is a chain of k = B, or an EAGLE-2 tree of B nodes (depth
and top-k per budget below). Each speculative engine and the speculation-off engine are
alive together and measured in interleaved rounds (off, spec, spec, off, ...); the table
reports medians. Greedy, held-out chat prompts, 32 new tokens.

    python benchmarks/spec_tree.py [--out benchmarks/results] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import warnings

from spec_sweep import heldout_chats, run  # (benchmarks/, next to this script)

from cluster import LLM
from cluster.config.speculative import builtin_head_path
from cluster.models.default_model import ensure_default_model

warnings.filterwarnings("ignore")

# budget -> (tree depth, topk)
TREES = {4: (3, 2), 8: (4, 3), 16: (5, 4)}


def interleaved(off: LLM, spec: LLM, prompts: list[list[int]], rounds: int, new_tokens: int):
    """Median tokens/s of each side over `rounds` of (off, spec, spec, off), and the
    speculative side's summed metric deltas."""
    off_tps, spec_tps, deltas = [], [], {}
    for _ in range(rounds):
        for side in ("off", "spec", "spec", "off"):
            tps, d = run(off if side == "off" else spec, prompts, new_tokens)
            (off_tps if side == "off" else spec_tps).append(tps)
            if side == "spec":
                deltas = {k: deltas.get(k, 0) + v for k, v in d.items()}
    return statistics.median(off_tps), statistics.median(spec_tps), deltas


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--budgets", type=int, nargs="+", default=list(TREES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    path = ensure_default_model()
    head = {"method": "eagle3", "model": builtin_head_path("smollm2-eagle3")}
    engine = dict(dtype="float32", max_model_len=512, max_num_seqs=max(args.batches))
    rows = []
    with LLM(path, **engine) as off:
        chats = heldout_chats(off, max(args.batches))
        run(off, chats[:1], 4)  # warm-up
        for budget in args.budgets:
            depth, topk = TREES[budget]
            shapes = {
                "chain": {"num_speculative_tokens": budget},
                "tree": {
                    "num_speculative_tokens": depth,
                    "tree": {"topk": topk, "num_nodes": budget},
                },
            }
            for kind, shape in shapes.items():
                with LLM(path, speculative_config={**head, **shape}, **engine) as spec:
                    run(spec, chats[:1], 4)  # warm-up
                    for batch in args.batches:
                        base, tps, d = interleaved(
                            off, spec, chats[:batch], args.rounds, args.new_tokens
                        )
                        drafts = d["num_drafts"] or 1
                        rows.append(
                            dict(
                                budget=budget,
                                kind=kind,
                                shape=f"k={budget}" if kind == "chain" else
                                f"depth {depth}, top-{topk}, {budget} nodes",
                                batch=batch,
                                tok_s=tps,
                                off_tok_s=base,
                                speedup=tps / base,
                                mean_acceptance_length=1 + d["num_accepted_tokens"] / drafts,
                                drafts_per_step=d["num_draft_tokens"] / drafts,
                            )
                        )  # fmt: skip
                        print(json.dumps(rows[-1]), flush=True)

    lines = [
        "# Chain vs tree drafting at equal verified-token budgets (SmolLM2-135M-Instruct, "
        f"float32, greedy, shipped EAGLE-3 head, {args.new_tokens} new tokens, held-out "
        f"prompts; medians of {args.rounds} interleaved rounds)\n",
        "| budget | drafting | shape | batch | spec tok/s | off tok/s | speedup "
        "| mean acceptance length | drafts per step |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget']} | {r['kind']} | {r['shape']} | {r['batch']} | {r['tok_s']:.1f} "
            f"| {r['off_tok_s']:.1f} | {r['speedup']:.2f} | {r['mean_acceptance_length']:.2f} "
            f"| {r['drafts_per_step']:.1f} |"
        )
    with open(os.path.join(args.out, "spec_tree.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "spec_tree.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
